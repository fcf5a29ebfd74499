"""End-to-end training-time projection (Pal et al., IEEE Micro 2019): time to target =
epochs(global batch) x steps per epoch x step time, for data parallelism, hybrid DP x MP and (CNNs)
channel/filter layouts, at every GPU count.

Strategies on N GPUs at per-worker batch b:
- DP:        N workers, global batch N*b; step = compute(b) + exposed allreduce of all gradients over N
             ranks (DDP-style 25 MiB buckets launched as backward produces them).
- DPxMP(M):  N/M workers of M GPUs inside one node, global batch (N/M)*b; step = placer's MP step at
             batch b + exposed concurrent allreduce of each device's gradients across the N/M replicas.
- CF(P):     CNNs: the global batch of N/P workers, (N/P)*b, on all N GPUs with the per-layer planner's
             sample/channel/filter layouts (Dryden et al.; segmented allreduce and overlap included).
Step costs come from a `StepCosts` backend (`CostModelBackend` uses hybridpar.cost, the placer and the
planner); the projection arithmetic is independent of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any, Protocol

import yaml

from hybridpar.convergence.builtin import WorkloadCurve
from hybridpar.cost.buckets import ddp_buckets, overlapped_end, shared_links_end
from hybridpar.errors import InfeasibleError, UserError
from hybridpar.search import budget

MP_DEGREES = (2, 4, 8)


@cache
def projection_data() -> dict[str, Any]:
    text = resources.files("hybridpar.convergence").joinpath("data/projection.yaml").read_text()
    return yaml.safe_load(text)


def default_batch_per_gpu(model: str) -> int:
    table = projection_data()["batch_per_gpu"]
    return int(table.get(model, table["default"])["value"])


def paper_margin(model: str) -> float | None:
    v = projection_data()["paper_margins"].get(model)
    return float(v) if isinstance(v, (int, float)) else None


# ---------------------------------------------------------------------------------------------------
# Step costs


@dataclass(frozen=True)
class Profile:
    """One worker on one GPU at batch b: forward/backward time, gradient bytes in the order backward
    produces them (`grad_ready`: (seconds into backward, bytes)), and resident memory."""

    fwd_s: float
    bwd_s: float
    param_bytes: int
    grad_ready: tuple[tuple[float, int], ...]
    memory_bytes: int

    @property
    def compute_s(self) -> float:
        return self.fwd_s + self.bwd_s


@dataclass(frozen=True)
class MPStep:
    """One M-GPU model-parallel worker at batch b (from the placer)."""

    step_s: float
    device_param_bytes: tuple[int, ...]  # weights held by each of the M devices
    memory_bytes: tuple[int, ...]
    solver: str = ""
    gap: float | None = None
    # per device, its layers' gradients in the order backward produces them: (fraction of the one-GPU
    # backward done when the gradient is ready, bytes); empty where the placement names no modules
    device_grad_ready: tuple[tuple[tuple[float, int], ...], ...] = ()


@dataclass(frozen=True)
class CFStep:
    step_s: float
    exposed_comm_s: float
    memory_bytes: int
    method: str = ""


class StepCosts(Protocol):
    """What the projection asks of the cost model."""

    capacity_bytes: float
    gpus_per_node: int
    is_cnn: bool

    def profile(self, batch: int) -> Profile: ...

    def allreduce_s(self, bytes_: int, ranks: int) -> float: ...

    def hybrid_allreduce_s(self, bytes_: int, replicas: int, mp: int, active: int | None = None) -> float: ...

    def mp_step(self, mp: int, batch: int) -> MPStep: ...

    def cf_step(self, gpus: int, groups: int, batch_global: int) -> CFStep | None: ...


FSDP_DETAIL = "FSDP + full recomputation (zero=3, every block recomputed)"


def fsdp_recompute_step(prof: Profile, ar_s: Callable[[int], float]) -> tuple[float, float]:
    """(step s, exposed communication s) of FSDP + full recomputation on the one-GPU profile: the
    parameters all-gathered under forward and again under backward, the gradients reduce-scattered
    under backward, each priced as half the ring allreduce of the parameters (a ring allreduce is a
    reduce-scatter then an all-gather of the same bytes), prefetching hiding them behind compute up to
    its length; backward recomputes the forward. The per-layer planner prices it block by block
    (hybridpar.search.layers.fsdp_baseline)."""
    half = ar_s(prof.param_bytes) / 2
    compute = 2 * prof.fwd_s + prof.bwd_s
    step = max(prof.fwd_s, half) + max(prof.fwd_s + prof.bwd_s, 2 * half)
    return step, step - compute


def _fsdp_points(costs: StepCosts, prof: Profile, n: int, batch: int, scale: _Scale) -> list[Point]:
    """FSDP + full recomputation at n > 1 GPUs, where the backend prices its memory (`fsdp_memory`:
    a backend without it projects no FSDP points)."""
    fsdp_memory = getattr(costs, "fsdp_memory", None)
    if n == 1 or fsdp_memory is None:
        return []
    step, exposed = fsdp_recompute_step(prof, lambda nb: costs.allreduce_s(nb, n))
    return [scale.point(n, "FSDP", n, 1, step, exposed, fsdp_memory(n, batch), FSDP_DETAIL)]


# ---------------------------------------------------------------------------------------------------
# Projection


@dataclass(frozen=True)
class Point:
    """One strategy at one GPU count."""

    gpus: int
    strategy: str  # "DP", "DPxMP2", ..., "CF2", ...
    dp: int
    mp: int
    global_batch: int
    epochs: float
    epochs_lo: float
    epochs_hi: float
    steps: float
    step_s: float
    exposed_comm_s: float
    time_s: float
    speedup: float
    speedup_lo: float
    speedup_hi: float
    memory_bytes: int
    fits: bool
    extrapolated: bool
    detail: str = ""  # how the step was found (placer solver, planner method)

    @property
    def family(self) -> str:
        if self.strategy in ("DP", "FSDP"):  # FSDP: the second baseline, FSDP + full recomputation
            return self.strategy
        return "hybrid" if self.strategy.startswith("DPxMP") else "CF"


@dataclass(frozen=True)
class Projection:
    model: str
    cluster: str
    batch_per_gpu: int
    curve: WorkloadCurve
    points: tuple[Point, ...]
    baseline_time_s: float
    notes: tuple[str, ...] = field(default=())

    def at(self, gpus: int) -> list[Point]:
        return [p for p in self.points if p.gpus == gpus]

    def best(self, gpus: int, family: str | None = None, *, fitting: bool = False) -> Point | None:
        cands = [p for p in self.at(gpus) if (family is None or p.family == family) and (p.fits or not fitting)]
        return min(cands, key=lambda p: p.time_s, default=None)

    @property
    def gpu_counts(self) -> list[int]:
        return sorted({p.gpus for p in self.points})

    def hybrid_wins(self) -> list[int]:
        """GPU counts at which the best hybrid DPxMP option beats DP-only (memory not enforced)."""
        return [n for n in self.gpu_counts if (h := self.best(n, "hybrid")) is not None
                and (d := self.best(n, "DP")) is not None and h.time_s < d.time_s]

    def crossover(self) -> int | None:
        """Smallest GPU count at which hybrid DPxMP overtakes DP-only."""
        wins = self.hybrid_wins()
        return wins[0] if wins else None

    def margin_at_scale(self) -> float | None:
        """1 - T(best hybrid) / T(DP) at the largest GPU count."""
        n = self.gpu_counts[-1]
        h, d = self.best(n, "hybrid"), self.best(n, "DP")
        return None if h is None or d is None else 1.0 - h.time_s / d.time_s

    def margin_best_vs_best(self) -> float | None:
        """1 - min over N of T(hybrid) / min over N of T(DP): hybrid's best against DP's best."""
        hs = [p.time_s for p in self.points if p.family == "hybrid"]
        ds = [p.time_s for p in self.points if p.family == "DP"]
        return None if not hs or not ds else 1.0 - min(hs) / min(ds)

    def to_dict(self) -> dict[str, Any]:
        pm = paper_margin(self.model)
        return {
            "model": self.model, "cluster": self.cluster, "batch_per_gpu": self.batch_per_gpu,
            "convergence": {**self.curve.curve.to_dict(), "target": self.curve.target,
                            "samples_per_epoch": self.curve.samples_per_epoch, "borrowed": self.curve.borrowed,
                            "notes": self.curve.notes()},
            "baseline_1gpu_time_s": self.baseline_time_s if self.curve.samples_per_epoch else None,
            "points": [{**p.__dict__, "family": p.family,
                        "time_s": p.time_s if self.curve.samples_per_epoch else None} for p in self.points],
            "best": {str(n): (b.strategy if (b := self.best(n)) else None) for n in self.gpu_counts},
            "crossover_gpus": self.crossover(),
            "hybrid_wins_at": self.hybrid_wins(),
            "margin_at_scale": self.margin_at_scale(),
            "margin_best_vs_best": self.margin_best_vs_best(),
            "paper_margin": pm,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class _Scale:
    """What turns one strategy's step into a Point: the convergence curve, samples per epoch, the
    one-GPU time to target, each device's memory and the per-GPU batch."""

    wc: WorkloadCurve
    spe: float
    base_s: float
    capacity: float
    batch: int

    def point(self, gpus: int, strategy: str, dp: int, mp: int, step_s: float, exposed_s: float, memory: int,
              detail: str = "") -> Point:
        gb = dp * self.batch
        e = self.wc.curve.epochs(gb)
        lo, hi = self.wc.curve.epochs_band(gb)
        steps = e * self.spe / gb
        t = steps * step_s
        br = getattr(self.wc.curve, "batch_range", None)
        extrap = bool(br) and not (br[0] <= gb <= br[1])
        per_epoch = self.spe / gb * step_s
        return Point(gpus, strategy, dp, mp, gb, e, lo, hi, steps, step_s, exposed_s, t, self.base_s / t,
                     self.base_s / (hi * per_epoch), self.base_s / (lo * per_epoch), int(memory),
                     memory <= self.capacity, extrap, detail)


def project(costs: StepCosts, curve: WorkloadCurve, gpus: Sequence[int], batch_per_gpu: int, *,
            model: str = "model", cluster: str = "cluster", mp_degrees: Sequence[int] = MP_DEGREES,
            bucket_bytes: int | None = None, progress: Callable[[str], None] | None = None) -> Projection:
    """Project every strategy at every GPU count; speedups are over one GPU at batch_per_gpu."""
    if batch_per_gpu < 1:
        raise UserError(f"batch_per_gpu must be >= 1, got {batch_per_gpu}", param="batch_per_gpu")
    if not gpus or any(g < 1 for g in gpus):
        raise UserError("gpus must list positive GPU counts", param="gpus")
    budget.check_projection(gpus, mp_degrees)
    bucket = int(bucket_bytes or projection_data()["ddp_bucket_bytes"]["value"])
    spe = float(curve.samples_per_epoch or 1.0)
    prof = costs.profile(batch_per_gpu)
    e1 = curve.curve.epochs(batch_per_gpu)
    base_s = e1 * spe / batch_per_gpu * prof.compute_s
    scale = _Scale(curve, spe, base_s, costs.capacity_bytes, batch_per_gpu)
    notes: list[str] = []
    pts: list[Point] = []
    for n in sorted(set(gpus)):
        if progress:
            progress(f"{n} GPUs")
        exposed = 0.0
        if n > 1:
            end = overlapped_end(prof.grad_ready, bucket, lambda nb, n=n: costs.allreduce_s(nb, n))
            exposed = max(0.0, end - prof.bwd_s)
        pts.append(scale.point(n, "DP", n, 1, prof.compute_s + exposed, exposed, prof.memory_bytes))
        pts += _fsdp_points(costs, prof, n, batch_per_gpu, scale)
        for m in mp_degrees:
            if m > n or n % m or m > costs.gpus_per_node:
                continue
            try:
                mps = costs.mp_step(m, batch_per_gpu)
            except InfeasibleError as err:
                notes.append(f"DPxMP{m}: {err}")
                continue
            d = n // m
            exposed = 0.0
            if d > 1:
                exposed = _hybrid_exposed(mps, prof, d, m, bucket, costs)
            pts.append(scale.point(n, f"DPxMP{m}", d, m, mps.step_s + exposed, exposed, max(mps.memory_bytes),
                                   mps.solver))
        if costs.is_cnn:
            for p in mp_degrees:
                if p > n or n % p:
                    continue
                cf = costs.cf_step(n, n // p, (n // p) * batch_per_gpu)
                if cf is not None:
                    pts.append(scale.point(n, f"CF{p}", n // p, p, cf.step_s, cf.exposed_comm_s, cf.memory_bytes,
                                           cf.method))
    if not curve.samples_per_epoch:
        notes.append("samples per epoch unknown: absolute times are not meaningful, speedups are")
    return Projection(model, cluster, batch_per_gpu, curve, tuple(pts), base_s, tuple(dict.fromkeys(notes)))


def band_sensitivity(costs: StepCosts, curve: WorkloadCurve, gpus: Sequence[int], batch_per_gpu: int,
                     **kw: Any) -> dict[str, dict[str, Any]]:
    """Crossover and margins with b_noise at -1 and +1 standard deviation (McCandlish curves only):
    how much the conclusion depends on the convergence data. Step costs are cached, so this is cheap."""
    from dataclasses import replace

    from hybridpar.convergence.curve import McCandlishCurve

    c = curve.curve
    if not isinstance(c, McCandlishCurve) or c.b_noise_sd <= 0:
        return {}
    out = {}
    for label, bn in (("b_noise-1sd", max(c.b_noise - c.b_noise_sd, c.b_noise * 0.05)),
                      ("b_noise+1sd", c.b_noise + c.b_noise_sd)):
        wc = replace(curve, curve=replace(c, b_noise=bn))
        p = project(costs, wc, gpus, batch_per_gpu, **kw)
        out[label] = {"b_noise": bn, "crossover_gpus": p.crossover(), "margin_at_scale": p.margin_at_scale(),
                      "margin_best_vs_best": p.margin_best_vs_best()}
    return out


def _hybrid_exposed(mps: MPStep, prof: Profile, replicas: int, mp: int, bucket: int, costs: StepCosts) -> float:
    """Exposed DP allreduce of a hybrid step: each device's gradients, bucketed as DDP does (a layer's
    gradient larger than a bucket goes in a bucket of its own, as in the DP points), each ready at the
    same fraction of the backward as in the one-GPU profile, that backward compressed into the MP
    step's backward share (the single-GPU bwd/(fwd+bwd) ratio: APPROXIMATION). The M device groups
    share the links while they allreduce at the same time (shared_links_end); the last to finish sets
    the time. Why per layer: splitting a device's bytes into bucket-sized pieces, as this did before
    2026-12-04, paid one allreduce's latency per 25 MiB (at 4,096 V100s ~17 ms over 512 nodes) and put
    BigLSTM's DPxMP2 0.71 s of exposed allreduce behind DP's 0.25 s at the same scale; and pricing
    every bucket with all M groups on the links charged contention to a device allreducing alone.
    Without a per-layer list (a placement that names no modules) the heaviest device's bytes are
    spread evenly over the backward, every group as busy."""
    window = mps.step_s * prof.bwd_s / prof.compute_s
    lists = mps.device_grad_ready
    if not lists or not any(lists):
        nbytes = max(mps.device_param_bytes)
        k = max(1, math.ceil(nbytes / bucket))
        even = [(window * (i + 1) / k, nbytes // k) for i in range(k)]
        end = overlapped_end(even, bucket, lambda nb: costs.hybrid_allreduce_s(nb, replicas, mp))
        return max(0.0, end - window)
    queues = [ddp_buckets([(window * f, b) for f, b in ready], bucket) for ready in lists]
    end = shared_links_end(queues, lambda nb, k: costs.hybrid_allreduce_s(nb, replicas, mp, active=k))
    return max(0.0, end - window)
