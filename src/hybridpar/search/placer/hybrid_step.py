"""Per-step time of hybrid data x model parallelism (Pal et al. 2019): D replicas of an M-device placement.

step(D x M) = the MP step at the per-worker batch (the placer's schedule) + the exposed part of the DP
allreduce: device d of every replica allreduces its own weights' gradients with device d of the other
D-1 replicas. Overlap with backward is modelled as torch DDP does it: gradients are packed in
25 MiB buckets in the order the placer's schedule finishes their backward ops; a bucket's allreduce
starts when its last gradient is ready and after the previous bucket on that device; the step ends
when both the MP schedule and every device's last allreduce have finished. The M groups allreduce at
the same time and share links: each bucket's time is scaled by concurrent_allreduce_time / allreduce_time
of the groups (cost.collectives). Approximation: the weight update stays inside backward as in the MP
model; the update after the last bucket is not added (it is < 1% of the step for the zoo models).
Replica r uses devices r*M .. r*M+M-1 of the cluster (an MP group inside one node when M divides it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from hybridpar.cluster import Cluster, load_cluster
from hybridpar.cost.buckets import ddp_buckets
from hybridpar.cost.collectives import allreduce_time, concurrent_allreduce_time
from hybridpar.cost.memory import DDP_BUCKET_BYTES
from hybridpar.errors import UserError
from hybridpar.search.placer.config import PROJECTION_OPTIMIZER, PlacerConfig
from hybridpar.search.placer.result import PlacementResult, evaluate


@dataclass(frozen=True)
class HybridStep:
    dp: int
    mp: int
    batch_per_worker: int
    step_time_s: float
    mp_step_s: float  # the placer's per-step time of one replica
    allreduce_s: float  # the slowest device's allreduce time if nothing overlapped
    exposed_allreduce_s: float  # step_time_s - mp_step_s
    per_device_allreduce_s: tuple[float, ...]
    solver: str
    gap: float | None

    @property
    def global_batch(self) -> int:
        return self.dp * self.batch_per_worker


# hybrid_step_time's search when the caller gives none: a shorter ILP than `place`'s, and the
# projection's optimizer (momentum SGD, as Pal et al.'s models train)
HYBRID_PLACER = PlacerConfig(time_limit_s=20.0, **PROJECTION_OPTIMIZER)


def hybrid_step_time(model, cluster: str | Cluster, dp: int, mp: int, batch_per_worker: int,
                     config: PlacerConfig | None = None, *, placement: Mapping[str, int] | None = None,
                     bucket_bytes: int = DDP_BUCKET_BYTES, **options) -> HybridStep:
    """Predicted step of D x M hybrid training at `batch_per_worker` samples per replica.

    model: zoo name, file spec or Graph (a name caches the placement per (model, cluster, M, batch)).
    placement: module or fine node name -> device to time instead of searching (e.g. a Plan's placement).
    config (default HYBRID_PLACER) with keyword `options` over it: the placer's solver, time_limit_s,
    coarsen and the optimizer each replica steps with (PlacerConfig's fields; api.build_problem)."""
    cfg = PlacerConfig.of(config or HYBRID_PLACER, options)
    solver, time_limit_s, coarsen, optimizer = cfg.solver, cfg.time_limit_s, cfg.coarsen, cfg.optimizer_kind
    if dp < 1 or mp < 1:
        raise UserError(f"dp and mp must be >= 1, got dp={dp}, mp={mp}")
    full = cluster if isinstance(cluster, Cluster) else load_cluster(cluster, dp * mp)
    if dp * mp > full.num_devices:
        raise UserError(f"{dp}x{mp} = {dp * mp} devices, cluster {full.name!r} has {full.num_devices}")
    # each replica's MP group is priced on the whole D x M cluster: where ranks share cores (localhost),
    # all D x M ranks compete for them; then re-timed with the share its busy ranks actually see
    # (_busy_share: an MP rank idles in its receives, so fewer than D x M compute at once)
    if placement is not None or not isinstance(model, str) or not isinstance(cluster, str):
        result = _mp_result(model, full, mp, batch_per_worker, solver, time_limit_s, coarsen, placement, optimizer)
    else:
        result = _cached_mp_result(model, cluster, dp * mp, mp, batch_per_worker, solver, time_limit_s, coarsen,
                                   optimizer)
    if dp > 1:
        result, full = _busy_share(result, model, full, mp, batch_per_worker, coarsen, optimizer)
    return _with_allreduce(result, full, dp, mp, batch_per_worker, bucket_bytes)


BUSY_SHARE_ROUNDS = 4


def _busy_share(result: PlacementResult, model, cluster: Cluster, mp: int, batch: int, coarsen: int | None,
                optimizer: str) -> tuple[PlacementResult, Cluster]:
    """Where ranks share cores (localhost), the D x M ranks do not all compute at once: a model-parallel
    rank waits in its receives for part of the step. The time share ranks/cores assumes every rank
    busy. Here a busy rank of device d is stretched by its expected share of a core: E[max(1, n/cores)]
    over n, the ranks computing with it, each other rank busy independently with its device's busy
    fraction in the schedule (D-1 more on device d, D on each other device); times the calibrated
    slowest-rank pace. The same placement is re-timed with each device's stretch, BUSY_SHARE_ROUNDS
    times (each from the fractions of the round before; no convergence test). Why: inception_mini's
    mp=2 x sample=2 on 2 cores (device 0 busy 92% of the step, device 1 23%) was priced 23-25% slower
    than its mp=2 and measured 0.94-1.01x of it
    (benchmarks/bench_validation.py, 2026-12-01 07:39 and 21:36 UTC). Approximation: independence of
    the ranks' busy periods. Nothing changes where ranks have a device each (time share 1)."""
    from hybridpar.cluster.localhost import oversubscription, physical_cores

    if cluster.name != "localhost":
        return result, cluster
    cores = physical_cores()
    world = cluster.num_devices
    if oversubscription(world, cores) <= 1.0:
        return result, cluster
    base = result.problem  # priced at the uniform share: ranks/cores x pace
    uniform = base.time_share
    pace = uniform / oversubscription(world, cores)
    dp = world // mp
    for _ in range(BUSY_SHARE_ROUNDS):
        sched, step = result.schedule, result.step_time_s
        busy = [0.0] * mp
        for op, st, en in zip(sched.ops, sched.start, sched.end):
            if op.kind in ("fwd", "bwd"):
                busy[op.device] += en - st
        frac = [min(1.0, b / step) if step > 0 else 1.0 for b in busy]
        factor = tuple(_expected_stretch(d, frac, dp, cores) * pace / uniform for d in range(mp))
        result = evaluate(_stretched(base, factor), list(result.assignment), result.solver, status="heuristic",
                          notes=result.notes)  # the same placement re-timed: a search's bound is dropped
    share = sum(factor) / mp * uniform
    return result, cluster.model_copy(update={"device": cluster.device.model_copy(update={"time_share": share})})


def _expected_stretch(device: int, frac: list[float], dp: int, cores: int) -> float:
    """E[max(1, n / cores)] for a busy rank of `device`: n = 1 + the other ranks busy at that moment."""
    dist = [1.0]  # dist[k]: probability that k other ranks are busy
    others = [f for d, f in enumerate(frac) for _ in range(dp - (d == device))]
    for p in others:
        nxt = [0.0] * (len(dist) + 1)
        for k, q in enumerate(dist):
            nxt[k] += q * (1 - p)
            nxt[k + 1] += q * p
        dist = nxt
    return sum(q * max(1.0, (1 + k) / cores) for k, q in enumerate(dist))


def _stretched(prob, factor: tuple[float, ...]):
    """`prob` with each device's compute scaled by its factor (the runtime's fixed costs by the mean)."""
    import dataclasses

    mean = sum(factor) / len(factor)
    tasks = tuple(dataclasses.replace(t, fwd_s=tuple(x * f for x, f in zip(t.fwd_s, factor)),
                                      bwd_s=tuple(x * f for x, f in zip(t.bwd_s, factor)),
                                      overhead_s=t.overhead_s * mean) for t in prob.tasks)
    return dataclasses.replace(prob, tasks=tasks, update_call_s=prob.update_call_s * mean,
                               time_share=prob.time_share * mean)


def price_placement(model, cluster: str | Cluster, mp: int, batch: int, placement: Mapping[str, int], *,
                    world: int | None = None, optimizer: str = "momentum") -> PlacementResult:
    """The placer's price of a given placement (module or fine node name -> device, e.g. a Plan's) of one
    M-device replica at `batch` samples, without searching. `world`: ranks running at once (D x M;
    default M), which sets the time share where ranks share cores."""
    full = cluster if isinstance(cluster, Cluster) else load_cluster(cluster, world or mp)
    return _mp_result(model, full, mp, batch, "given", 0.0, None, placement, optimizer)


@lru_cache(maxsize=256)
def _cached_mp_result(model: str, cluster: str, world: int, mp: int, batch: int, solver: str, time_limit_s: float,
                      coarsen: int | None, optimizer: str) -> PlacementResult:
    return _mp_result(model, load_cluster(cluster, world), mp, batch, solver, time_limit_s, coarsen, None, optimizer)


def _mp_result(model, cluster, mp: int, batch: int, solver: str, time_limit_s: float, coarsen: int | None,
               placement: Mapping[str, int] | None, optimizer: str = "momentum") -> PlacementResult:
    from hybridpar.search.placer import solve
    from hybridpar.search.placer.adapter import members, node_modules
    from hybridpar.search.placer.api import build_problem
    from hybridpar.search.placer.unroll import tie_name

    prob, coarse, *_ = build_problem(model, cluster, mp, batch=batch, coarsen=coarsen, optimizer=optimizer)
    if placement is None:
        return solve(prob, "single" if mp == 1 else solver, time_limit_s=time_limit_s, workers=2)
    assignment: list[int] = []
    by_tie: dict[str, int] = {}  # the time chunks of one node share its device
    for n in coarse.nodes:
        keys = [*node_modules(n), *members(n)]  # modules, then fine node names (concat/add)
        devs = [placement[k] for k in keys if k in placement]
        d = by_tie.get(tie_name(n), devs[0] if devs else (assignment[-1] if assignment else 0))
        if not 0 <= d < mp:
            raise UserError(f"placement puts {n.name} on device {d}, outside 0..{mp - 1}")
        by_tie[tie_name(n)] = d
        assignment.append(d)
    return evaluate(prob, assignment, "given")


def _with_allreduce(result: PlacementResult, cluster: Cluster, dp: int, mp: int, batch: int,
                    bucket_bytes: int) -> HybridStep:
    mp_step = result.step_time_s
    if dp == 1:
        return HybridStep(dp, mp, batch, mp_step, mp_step, 0.0, 0.0, (0.0,) * mp, result.solver, result.gap)
    prob, sched = result.problem, result.schedule
    groups = [[r * mp + d for r in range(dp)] for d in range(mp)]
    done: list[list[tuple[float, int]]] = [[] for _ in range(mp)]  # (backward end, gradient bytes)
    for op, end in zip(sched.ops, sched.end):
        if op.kind == "bwd" and prob.tasks[op.task].grad_bytes:
            done[op.device].append((end, prob.tasks[op.task].grad_bytes))
    heaviest = max((sum(b for _, b in d) for d in done), default=0)
    alone = allreduce_time(heaviest, groups[0], cluster) if heaviest else 0.0
    together = concurrent_allreduce_time(heaviest, groups, cluster) if heaviest else 0.0
    contention = together / alone if alone > 0 else 1.0
    finish, total = [], []
    for d in range(mp):
        t_end = busy = 0.0
        for ready, size in ddp_buckets(sorted(done[d]), bucket_bytes):
            dt = allreduce_time(size, groups[d], cluster) * contention
            t_end = max(t_end, ready) + dt
            busy += dt
        finish.append(t_end + prob.update_call_s if t_end else 0.0)  # the optimizer steps after its sync
        total.append(busy)
    step = max([mp_step, *finish])
    return HybridStep(dp, mp, batch, step, mp_step, max(total), step - mp_step, tuple(total), result.solver,
                      result.gap)
