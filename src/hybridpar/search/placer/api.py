"""place_model: model + cluster + M devices -> the placement, its predicted step, and a Plan."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from hybridpar.cluster import Cluster, load_cluster
from hybridpar.cost.coverage import LABEL
from hybridpar.errors import InfeasibleError, UserError
from hybridpar.graph.types import Graph
from hybridpar.plans import Plan, Prediction
from hybridpar.search import budget
from hybridpar.search.placer.adapter import (
    RUNTIME_LEAVES,
    executor_node_overhead_s,
    placement_by_module,
    problem_from_graph,
    runtime_leaves,
    task_compute_s,
    tie_shared_modules,
)
from hybridpar.search.placer.config import PlacerConfig, optimizer_cost_name
from hybridpar.search.placer.micro import MicroCompute
from hybridpar.search.placer.problem import PlacementProblem
from hybridpar.search.placer.result import PlacementResult
from hybridpar.search.placer.unroll import WHAT_IF_TIME_CHUNKS, has_recurrence, split_layers, unroll

DEFAULT_CLUSTER = "localhost"  # one default everywhere (hybridpar.api.DEFAULT_CLUSTER)
DEFAULT_BATCH = 32  # per data-parallel worker (one MP group), when the caller gives none
# Coarse nodes the ILP sees by default. 64 rather than 32: Inception-V3's best placement within the
# projection's 5 s (1.25x / 1.44x on 2 / 4 V100s) beats the proven optimum at 32 nodes (1.11x / 1.15x);
# the solve is bounded by the time limit instead of ending with a proof (docs/placer.md).
DEFAULT_COARSEN = 64


def one_process_step_s(prob: PlacementProblem) -> float:
    """The step of one process running the whole model eagerly on device 0 (what the speedup is
    over): every task one after the other, without the MP runtime's own costs (its executor's work
    per node and its loss allreduce); with the optimizer's calls, which one process makes too. Alone on
    the machine: not stretched by the group's time share (ranks sharing cores, the slowest rank)."""
    work = sum(t.fwd_s[0] + t.bwd_s[0] - t.overhead_s for t in prob.tasks) + prob.update_call_s
    return work / prob.time_share


@dataclass(frozen=True)
class PlaceOutcome:
    result: PlacementResult
    single_step_s: float  # the same model on one device (memory ignored; see single_fits)
    single_fits: bool
    baselines: dict[str, float]  # baseline name -> predicted step time (those that fit)
    plan: Plan
    graph: Graph  # the coarse graph that was placed
    fine_nodes: int
    notes: tuple[str, ...] = field(default=())
    # each task's op seconds at the batch and at one of K micro-batches (placer.micro.micro_problem)
    micro_compute: MicroCompute | None = field(default=None, repr=False, compare=False)

    @property
    def step_time_s(self) -> float:
        """The predicted step as the plan runs: with its micro-batches (placer.micro)."""
        return self.plan.predicted.step_time_s if self.plan.predicted is not None else self.result.step_time_s

    @property
    def memory_bytes(self) -> list:
        """Each device's predicted bytes as the plan runs: with its micro-batch schedule (1F1B holds fewer
        activations; placer.micro.pipeline_memory)."""
        p = self.plan.predicted
        return list(p.memory_bytes) if p is not None and p.memory_bytes else list(self.result.memory_bytes)

    @property
    def speedup(self) -> float | None:
        if self.step_time_s <= 0:
            return None
        return self.single_step_s / self.step_time_s

    @property
    def problem(self) -> PlacementProblem:
        return self.result.problem

    def summary(self) -> dict:
        r, bd = self.result, self.result.breakdown
        return {"model": self.plan.model, "cluster": self.plan.cluster, "devices": self.plan.mp,
                    "device_ids": list(self.problem.device_ids), "batch": self.plan.batch, "solver": r.solver,
                    "status": r.status, "nodes": len(self.graph), "fine_nodes": self.fine_nodes,
                    "step_time_s": self.step_time_s, "single_device_step_s": self.single_step_s,
                    "micro_batches": self.plan.micro_batches, "schedule": self.plan.schedule,
                    "one_micro_batch_step_s": r.step_time_s,
                    "single_device_fits": self.single_fits,
                    "speedup": self.speedup, "gap": r.gap, "bound_s": r.bound_s, "solve_time_s": r.solve_time_s,
                    "compute_s": bd.compute_s, "exposed_comm_s": bd.exposed_comm_s, "comm_s": bd.comm_s,
                    "idle_s": bd.idle_s, "memory_bytes": self.memory_bytes,
                    "memory_capacity_bytes": list(self.problem.mem_capacity_bytes),
                    "baselines": self.baselines, "notes": list(self.notes) + list(r.notes),
                    # the note saying which op times are the roofline's, not measured here (a CPU), else None
                    "uncalibrated_estimate": next((n for n in self.notes if n.startswith(LABEL)), None),
                    "cost_notes": list(self.problem.notes)}  # what the prices hold (cluster, runtime, update)


@lru_cache(maxsize=16)
def _traced(model: str, batch: int, input_shape: tuple[int, ...] | None) -> tuple[Graph, str]:
    from hybridpar.graph.models import load_model
    from hybridpar.graph.tracing import trace

    # meta tensors: tracing needs shapes only, so BigLSTM's 1.8 B weights are never allocated
    lm = load_model(model, batch=batch, input_shape=input_shape, device="meta")
    return _with_leaves(trace(lm.module, lm.example_inputs, lm.name), lm.module), lm.name


def _with_leaves(graph: Graph, module) -> Graph:
    """The graph with the modules the MP runtime runs whole noted in its meta (adapter.runtime_leaves)."""
    import dataclasses

    leaves = runtime_leaves(module)
    return dataclasses.replace(graph, meta=(*graph.meta, (RUNTIME_LEAVES, leaves))) if leaves else graph


def model_graph(model, batch: int, input_shape: tuple[int, ...] | None = None) -> tuple[Graph, str]:
    """(fine graph, name) of a zoo name / file spec (cached), an nn.Module (needs example inputs via
    `model=(module, inputs)`), or a Graph."""
    if isinstance(model, Graph):
        return model, model.name
    if isinstance(model, str):
        return _traced(model, batch, tuple(input_shape) if input_shape else None)
    if isinstance(model, tuple) and len(model) == 2:
        from hybridpar.graph.tracing import trace

        g = _with_leaves(trace(model[0], model[1]), model[0])
        return g, g.name
    raise UserError("model must be a zoo name, 'file.py:factory', a Graph or (module, example_inputs)")


_COARSE: dict[tuple[int, int, int], tuple[Graph, Graph]] = {}  # (id(fine), nodes, chunks) -> (fine, coarse)


def _coarse(fine: Graph, max_nodes: int, chunks: int = 0) -> Graph:
    from hybridpar.graph.coarsen import coarsen_to

    key = (id(fine), max_nodes, chunks)
    hit = _COARSE.get(key)
    if hit is None or hit[0] is not fine:  # keep `fine` alive so its id is not reused
        tied = tie_shared_modules(fine)
        # unrolling multiplies the recurrent nodes by `chunks`: coarsen to budget / chunks first so
        # that the ILP sees at most about `max_nodes` tasks (GNMT: 35 -> 16 nodes -> 52 tasks)
        budget = max(2, max_nodes // chunks) if chunks >= 2 and has_recurrence(fine) else max_nodes
        # coarsen only when needed: collapsing chains would hide the splits a model needs to fit
        coarse = tied if len(tied) <= budget else coarsen_to(tied, budget)
        hit = _COARSE[key] = (fine, unroll(coarse, fine, chunks))
    return hit[1]


def what_if_note(chunks: int) -> str:
    """The label of a placement priced with K time chunks per recurrent node on a graph the MP runtime
    cannot chunk (torch.export's: no module calls to split; runs_time_chunks)."""
    return (f"WHAT-IF (--time-chunks {chunks}): each recurrent layer priced as {chunks} time chunks on a "
            "time-step wavefront; this model runs on torch.export's graph, where the MP runtime runs each "
            "recurrent layer whole, so `train` does not run this schedule")


def runs_time_chunks(fine: Graph) -> bool:
    """The MP runtime runs the time-chunk wavefront on torch.fx's graph (pipeline.wavefront splits
    nn.LSTM/GRU/RNN module calls), not on torch.export's."""
    return dict(fine.meta).get("tracer") == "torch.fx"


def time_chunk_note(chunks: int, fine: Graph) -> str:
    """The plan's note on its time chunks: executed (as `train --time-chunks K` runs it), else a what-if."""
    if not runs_time_chunks(fine):
        return what_if_note(chunks)
    return (f"time chunks: {chunks} per recurrent layer (the time-step wavefront, priced in the MP "
            f"runtime's program order; `train --time-chunks {chunks}` runs it)")


FREE_ORDER_NOTE = ("WHAT-IF (free order): priced with each device free to run any ready operation first "
                   "(DLPlacer's schedule); the MP runtime runs every device in program order, so `train` is "
                   "slower than this prediction where the placement needs reordering")


def build_problem(model, cluster: str | Cluster = DEFAULT_CLUSTER, gpus: int = 2, config: PlacerConfig | None = None,
                  **options) -> tuple[PlacementProblem, Graph, Graph, Cluster, str]:
    """The placement problem of a model over `gpus` devices (`devices=` is the old name, still
    accepted) with `config` (a PlacerConfig; keyword `options` are its fields, over it). Its
    `time_chunks` K >= 2 splits recurrent nodes into K tied time chunks, a what-if the runtime does not
    run (None: the default, off; 0: off). Priced in the MP runtime's program order
    (schedule.program_schedule) unless `free_order` or time chunks ask for a free schedule (DLPlacer's,
    the runtime does not run it: a what-if). `optimizer`/`momentum` (`hybridpar train`'s words) set the
    optimizer state each device holds and the update's time. The returned coarse graph has one node per
    task."""
    gpus = options.pop("devices", gpus)
    cfg = PlacerConfig.of(config, options)
    cl = _checked_cluster(cluster, gpus, cfg)
    batch = DEFAULT_BATCH if cfg.batch is None else cfg.batch
    fine, name = model_graph(model, batch, cfg.input_shape)
    chunks = cfg.time_chunks or 0  # off by default: whole recurrent layers
    if chunks >= 2:  # the runtime places the layers of a stacked recurrent module one by one with chunks
        fine = split_layers(fine)
    coarse = _coarse(fine, cfg.coarsen or DEFAULT_COARSEN, chunks if chunks >= 2 else 0)
    # the runtime runs the chunks in program order too (pipeline.wavefront), unless the graph is
    # torch.export's (time_chunk_note): then only DLPlacer's free schedule is a fair what-if
    prob = problem_from_graph(coarse, fine, cl, tuple(range(gpus)), dtype=cfg.dtype, optimizer=cfg.optimizer_kind,
                              mem_capacity_bytes=cfg.mem_capacity_bytes,
                              program_order=not cfg.free_order and (
                                  "time_chunks" not in dict(coarse.meta) or runs_time_chunks(fine)))
    return prob, coarse, fine, cl, name


def _checked_cluster(cluster: str | Cluster, gpus: int, cfg: PlacerConfig) -> Cluster:
    """The cluster, after refusing (UserError naming the option) what no placement can have."""
    if gpus < 1:
        raise UserError(f"gpus must be >= 1, got {gpus}", param="gpus")
    optimizer_cost_name(cfg.optimizer, cfg.momentum)  # refuses an unknown optimizer
    if cfg.coarsen is not None and cfg.coarsen < 2:
        raise UserError(f"coarsen must be >= 2 nodes, got {cfg.coarsen}", param="coarsen")
    if cfg.batch is not None and cfg.batch < 1:
        raise UserError(f"batch must be >= 1, got {cfg.batch}", param="batch")
    if cfg.time_chunks is not None and cfg.time_chunks < 0:
        raise UserError(f"time_chunks must be >= 0 (0 = off), got {cfg.time_chunks}", param="time_chunks")
    cl = cluster if isinstance(cluster, Cluster) else load_cluster(cluster, gpus)
    if gpus > cl.gpus_per_node:
        # model parallelism sends activations at every cut: keep the group on one node's links
        raise UserError(f"gpus {gpus}: an MP group must fit in one node of {cl.name!r} "
                        f"({cl.gpus_per_node} devices)", param="gpus")
    return cl


def _check_search(cfg: PlacerConfig, gpus: int) -> None:
    from hybridpar.search.placer import SOLVERS

    if cfg.solver not in SOLVERS:
        raise UserError(f"unknown solver {cfg.solver!r}; choose one of {', '.join(SOLVERS)}")
    if not math.isfinite(cfg.time_limit_s):
        raise UserError(f"time_limit_s must be a finite number > 0, got {cfg.time_limit_s}", param="time_limit_s")
    if cfg.time_limit_s <= 0:
        raise UserError(f"time_limit_s must be > 0, got {cfg.time_limit_s}", param="time_limit_s")
    if isinstance(cfg.workers, bool) or not isinstance(cfg.workers, int) or cfg.workers < 1:
        raise UserError(f"workers must be >= 1, got {cfg.workers}", param="workers")
    if cfg.gap is not None and not (math.isfinite(cfg.gap) and 0.0 <= cfg.gap < 1.0):
        raise UserError(f"gap must be >= 0 and < 1, got {cfg.gap}", param="gap")
    if isinstance(gpus, int) and gpus > 0:
        budget.check(f"placement on {gpus:,} devices", budget.placer_tables_estimate(gpus),
                     "place on fewer devices")


def place_model(model, cluster: str | Cluster = DEFAULT_CLUSTER, gpus: int = 2, config: PlacerConfig | None = None,
                **options) -> PlaceOutcome:
    """Place `model` over `gpus` devices (0..gpus-1; `devices=` is the old name, still accepted) of
    `cluster` with `config` (a PlacerConfig; keyword `options` are its fields, over it: solver,
    time_limit_s, batch, coarsen, optimizer, ...).

    Returns the placement (solver result with schedule and gap), the one-device step for the speedup,
    every baseline's step, and a Plan (mp=gpus, placement keyed by module name). The ILP's answer
    depends only on the inputs, `time_limit_s` (deterministic time), `workers`, `seed` and `gap` (the
    ILP stops within this relative gap of its proven bound; None: ilp.DEFAULT_GAP). Priced in
    the MP runtime's program order; `free_order` prices DLPlacer's free schedule (a labelled what-if)."""
    from hybridpar.search.placer import solve

    gpus = options.pop("devices", gpus)
    cfg = PlacerConfig.of(config, options)
    _check_search(cfg, gpus)
    if cfg.time_chunks is None:
        chosen = _choose_time_chunks(model, cluster, gpus, cfg)
        if chosen is not None:
            return chosen
    prob, coarse, fine, cl, name = build_problem(model, cluster, gpus, cfg)
    if cfg.solver == "ilp":
        budget.check(f"placement of {len(prob.tasks):,} tasks on {gpus:,} devices",
                     budget.placer_ilp_estimate(len(prob.tasks), gpus),
                     "coarsen the graph (--coarsen N) or place on fewer devices")
    result = solve(prob.one_rank_busy() if cfg.solver == "single" else prob, cfg.solver,
                   time_limit_s=cfg.time_limit_s, workers=cfg.workers, seed=cfg.seed, gap=cfg.gap)
    result = _chain_for_1f1b(result, cfg)
    baselines = _baselines(prob)
    k = dict(coarse.meta).get("time_chunks", 0)
    what_if = bool(k) and not runs_time_chunks(fine)
    notes = ((time_chunk_note(k, fine),) if k else ()) + ((FREE_ORDER_NOTE,) if cfg.free_order and not what_if else ())
    plan = _outcome_plan(name, cl, gpus, cfg, result, coarse, fine)
    if notes:  # with time chunks the plan has that note already (_outcome_plan)
        plan = plan.model_copy(update={"notes": [*plan.notes, *(n for n in notes if n not in plan.notes)]})
    compute = micro_compute(coarse, fine, cl, cfg.dtype)
    plan = _with_micro_batches(plan, result, cfg, (fine, coarse, cl), compute)
    label = uncalibrated_note(model, fine, cl, cfg, plan)
    if label:  # first, as `plan` puts it: the CLI prints the outcome's notes, the report the plan's
        plan = plan.model_copy(update={"notes": [label, *plan.notes]})
        notes = (label, *notes)
    # one process runs recurrent layers whole (chunks cost more than 1/K each: cost.compute.chunk_time)
    one = build_problem(model, cluster, gpus, replace(cfg, time_chunks=1))[0] if k else prob
    return PlaceOutcome(result, one_process_step_s(one), "single" in baselines, baselines, plan, coarse, len(fine),
                        notes, compute)


def uncalibrated_note(model, fine: Graph, cl: Cluster, cfg: PlacerConfig, plan: Plan) -> str:
    """cost.coverage's label (issue 35) when some op time of the placement on this CPU is the roofline's,
    else "": every device runs its ops whole, at one micro-batch's samples (placer.micro)."""
    from hybridpar.cost.coverage import coverage

    k = plan.micro_batches or 1
    cov = coverage(fine, cl.device, lambda n: (1 / k, 1.0, 1.0), dtype=cfg.dtype)
    if cov is None:
        return ""
    # an nn.Module has no name `hybridpar profile` can load: the user's factory for it
    name = model if isinstance(model, str) else "path/to/file.py:factory" if isinstance(model, tuple) else plan.model
    shape = f" --input-shape {','.join(map(str, cfg.input_shape))}" if cfg.input_shape else ""
    return cov.note(f"--model {name}{shape} --batch {plan.batch}" + (f" --splits {k}" if k > 1 else ""))


def micro_compute(coarse: Graph, fine: Graph, cl: Cluster, dtype: str) -> MicroCompute:
    """Each task's ops priced at the whole batch and at one of K micro-batches (placer.micro.micro_problem)."""
    whole = task_compute_s(coarse, fine, cl, dtype=dtype)

    def compute(k: int):
        return whole, task_compute_s(coarse, fine, cl, dtype=dtype, sample_frac=1 / k)

    return compute


def _choose_time_chunks(model, cluster: str | Cluster, gpus: int, cfg: PlacerConfig) -> PlaceOutcome | None:
    """No time_chunks given: for a recurrent model the MP runtime can chunk, the placement of whole
    layers or of WHAT_IF_TIME_CHUNKS chunks, whichever has the shorter predicted step (both solved);
    None for any other model (nothing to choose)."""
    fine, _ = model_graph(model, DEFAULT_BATCH if cfg.batch is None else cfg.batch, cfg.input_shape)
    if gpus < 2 or cfg.schedule == "1f1b" or not has_recurrence(fine) or not runs_time_chunks(fine):
        return None  # (1f1b runs whole recurrent layers: parallel/pipeline/schedule.py)
    whole = place_model(model, cluster, gpus, replace(cfg, time_chunks=1))
    split = place_model(model, cluster, gpus, replace(cfg, time_chunks=WHAT_IF_TIME_CHUNKS))
    best = split if split.step_time_s < whole.step_time_s else whole
    note = (f"time chunks: {best.plan.time_chunks} chosen (predicted step {whole.step_time_s * 1e3:.4g} ms with "
            f"whole recurrent layers, {split.step_time_s * 1e3:.4g} ms with {WHAT_IF_TIME_CHUNKS} time chunks)")
    return replace(best, plan=best.plan.model_copy(update={"notes": [*best.plan.notes, note]}),
                   notes=(*best.notes, note))


def _with_micro_batches(plan: Plan, result: PlacementResult, cfg: PlacerConfig,
                        graphs: tuple[Graph, Graph, Cluster], compute: MicroCompute) -> Plan:
    """The plan with its micro-batch count and schedule (placer.micro.choose_pipeline): the ones given,
    or the pair with the shortest predicted step whose memory fits; the predicted step is then the
    pipelined one."""
    from hybridpar.search.placer.micro import chain_devices, choose_pipeline, pipeline_memory, task_activation_bytes

    fine, coarse, cl = graphs
    samples = plan.batch // plan.dp
    prob, assign = result.problem, result.assignment
    stages = chain_devices(prob, assign)
    _check_schedule_asked(cfg, samples, stages, plan.mp)
    acts = task_activation_bytes(coarse, fine, cfg.dtype)
    act = [acts.get(t.name, 0) for t in prob.tasks]
    schedules = (cfg.schedule,) if cfg.schedule is not None else ("gpipe", "1f1b")
    chunks = dict(coarse.meta).get("time_chunks") or 0
    if chunks > 1:  # the wavefront runs under the executor's GPipe only (pipeline.schedule.check_schedule)
        if cfg.schedule == "1f1b":
            raise UserError(f"1f1b runs whole recurrent layers: {chunks} time chunks (the wavefront) run under "
                            "--schedule gpipe only (or give --time-chunks 1)", param="schedule")
        schedules = ("gpipe",)
    if cfg.micro_batches is not None:
        counts, why = [cfg.micro_batches], "as asked"
    elif any(n.op == "batchnorm" for n in fine.nodes):
        counts, why = [1], "batch norm: statistics over the whole batch"
        schedules = ("gpipe",) if cfg.schedule is None else schedules
    elif cl.device.kind == "cpu" and not executor_node_overhead_s(cl):
        # measured on 2 CPU ranks: every K > 1 slower than one micro-batch (a micro-batch's fixed costs,
        # unpriced without the profiled executor cost, outweigh the overlap): no count is chosen on a
        # guess, whatever the schedule; a count asked for runs and is priced. 1f1b needs one micro-batch
        # per stage at least: the fewest it runs
        counts = [plan.mp] if cfg.schedule == "1f1b" else [1]
        why = ("the MP executor's cost per micro-batch is not measured on this CPU (run `hybridpar profile`); "
               + ("1f1b's fewest, one per stage; " if cfg.schedule == "1f1b" else "")
               + "give --micro-batches K to pipeline")
    else:
        counts, why = None, ""
    if counts == [1] and schedules == ("1f1b",):
        raise UserError("1f1b: the model's batch norm keeps one micro-batch (statistics over the whole batch); give "
                        "--micro-batches K (with --bn-stats local) or use --schedule gpipe", param="schedule")
    k, sched, steps, fits = choose_pipeline(prob, assign, samples, act, counts=counts, schedules=schedules,
                                            compute=compute)
    if not why:
        why = "the shortest predicted step of " + ", ".join(f"{n}: {v * 1e3:.3g} ms" for (n, s), v in steps.items()
                                                           if s == sched)
    notes = [f"micro-batches: {k} ({why})",
             f"schedule: {sched} (" + ("as asked" if cfg.schedule is not None else "chosen with the count: "
                                      + ", ".join(f"{n} {s}: {v * 1e3:.3g} ms" for (n, s), v in steps.items()
                                                  if n == k)) + ")"]
    memory = [int(m) for m in pipeline_memory(prob, assign, k, sched, act)]
    if not fits:
        notes.append(_over_memory_note(memory, prob.mem_capacity_bytes, (k, sched), len(steps)))
    update: dict = {"micro_batches": k, "schedule": sched, "notes": [*plan.notes, *notes]}
    if k > 1 and plan.predicted is not None:
        update["predicted"] = plan.predicted.model_copy(update={"step_time_s": steps[(k, sched)],
                                                                "memory_bytes": memory})
    return plan.model_copy(update=update)


def _over_memory_note(memory: list[int], capacity, chosen: tuple[int, str], candidates: int) -> str:
    """The plan's note when no (count, schedule) priced fits every device (choose_pipeline)."""
    d = max(range(len(memory)), key=lambda i: memory[i] - capacity[i])
    return (f"over the memory limit: device {d} holds {memory[d] / 2**20:,.2f} MiB of {capacity[d] / 2**20:,.2f} "
            f"MiB with {chosen[0]} micro-batch(es) ({chosen[1]}), the smallest peak of the {candidates} "
            "count/schedule pair(s) priced")


def _chain_for_1f1b(result: PlacementResult, cfg: PlacerConfig) -> PlacementResult:
    """1f1b asked of a placement that is not a chain of stages: the balanced pipeline split over every
    device instead (micro.chain_split); none: the placement as it is (1f1b is then refused, one line)."""
    from hybridpar.search.placer.micro import chain_devices, chain_split
    from hybridpar.search.placer.result import evaluate

    if cfg.schedule != "1f1b" or chain_devices(result.problem, result.assignment) is not None:
        return result
    split = chain_split(result.problem)
    if split is None:
        return result
    note = (f"1f1b asked: the {result.solver} placement is not a chain of stages; placed as the balanced "
            "pipeline split (placer.micro.chain_split)")
    return evaluate(result.problem, split, "pipeline split", notes=(note,))


def _check_schedule_asked(cfg: PlacerConfig, samples: int, stages: tuple[int, ...] | None, mp: int) -> None:
    if cfg.micro_batches is not None and cfg.micro_batches > samples:
        raise UserError(f"micro_batches {cfg.micro_batches} exceeds the {samples} samples per replica",
                        param="micro_batches")
    if cfg.schedule not in (None, "gpipe", "1f1b"):
        raise UserError(f"schedule must be gpipe or 1f1b, got {cfg.schedule!r}", param="schedule")
    if cfg.schedule != "1f1b":
        return
    if stages is None:
        raise UserError("1f1b: the placer's placement is not a chain of stages over all devices (an activation "
                        "skips or returns a stage, or a device holds nothing); use --schedule gpipe", param="schedule")
    k = cfg.micro_batches
    if k is not None and k < mp:
        raise UserError(f"1f1b needs at least as many micro-batches as stages: {k} < {mp}", param="micro_batches")
    if k is None and samples < mp:
        raise UserError(f"1f1b needs at least {mp} micro-batches, more than the {samples} samples per replica",
                        param="schedule")


def _baselines(prob: PlacementProblem) -> dict[str, float]:
    """Every baseline's predicted step (those that fit)."""
    from hybridpar.search.placer import BASELINES

    baselines: dict[str, float] = {}
    for bname, fn in BASELINES.items():
        with contextlib.suppress(InfeasibleError):  # a baseline that does not fit is left out
            # everything on device 0 computes alone: priced without the group's time share
            baselines[bname] = fn(prob.one_rank_busy() if bname == "single" else prob).step_time_s
    return baselines


def _outcome_plan(name: str, cl: Cluster, gpus: int, cfg: PlacerConfig, result: PlacementResult, coarse: Graph,
                  fine: Graph) -> Plan:
    """The Plan of a placement: mp = gpus, placement keyed by module name, the prediction and notes."""
    bd = result.breakdown
    chunks = dict(coarse.meta).get("time_chunks")
    return Plan(model=name, input_shape=list(cfg.input_shape) if cfg.input_shape else None, cluster=cl.name,
                world_size=gpus, batch=DEFAULT_BATCH if cfg.batch is None else cfg.batch, dp=1, mp=gpus,
                placement=placement_by_module(coarse, result.assignment, fine), strategy=f"mp={gpus}",
                predicted=Prediction(step_time_s=result.step_time_s, compute_s=bd.compute_s, comm_s=bd.comm_s,
                                     exposed_comm_s=bd.exposed_comm_s, idle_s=bd.idle_s,
                                     memory_bytes=[int(x) for x in result.memory_bytes]),
                notes=[f"placer: {result.solver} ({result.status}"
                       + (f", gap {result.gap:.2%}" if result.gap is not None else "") + ")",
                       f"graph coarsened {len(fine)} -> {len(coarse)} nodes"
                       + (f" ({chunks} time chunks per recurrent node)" if chunks is not None else ""),
                       *([time_chunk_note(chunks, fine)] if chunks is not None else [])],
                time_chunks=chunks or (1 if cfg.time_chunks is not None else None))
