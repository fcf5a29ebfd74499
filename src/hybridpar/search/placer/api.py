"""place_model: model + cluster + M devices -> the placement, its predicted step, and a Plan."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from functools import lru_cache

from hybridpar.cluster import Cluster, load_cluster
from hybridpar.cost.memory import OPTIMIZERS
from hybridpar.errors import InfeasibleError, UserError
from hybridpar.graph.types import Graph
from hybridpar.plans import Plan, Prediction
from hybridpar.search import budget
from hybridpar.search.placer.adapter import (
    RUNTIME_LEAVES,
    placement_by_module,
    problem_from_graph,
    runtime_leaves,
    tie_shared_modules,
)
from hybridpar.search.placer.problem import PlacementProblem
from hybridpar.search.placer.result import PlacementResult
from hybridpar.search.placer.unroll import has_recurrence, unroll

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

    @property
    def speedup(self) -> float | None:
        if self.result.step_time_s <= 0:
            return None
        return self.single_step_s / self.result.step_time_s

    @property
    def problem(self) -> PlacementProblem:
        return self.result.problem

    def summary(self) -> dict:
        r, bd = self.result, self.result.breakdown
        return {"model": self.plan.model, "cluster": self.plan.cluster, "devices": self.plan.mp,
                    "device_ids": list(self.problem.device_ids), "batch": self.plan.batch, "solver": r.solver,
                    "status": r.status, "nodes": len(self.graph), "fine_nodes": self.fine_nodes,
                    "step_time_s": r.step_time_s, "single_device_step_s": self.single_step_s,
                    "single_device_fits": self.single_fits,
                    "speedup": self.speedup, "gap": r.gap, "bound_s": r.bound_s, "solve_time_s": r.solve_time_s,
                    "compute_s": bd.compute_s, "exposed_comm_s": bd.exposed_comm_s, "comm_s": bd.comm_s,
                    "idle_s": bd.idle_s, "memory_bytes": r.memory_bytes,
                    "memory_capacity_bytes": list(self.problem.mem_capacity_bytes),
                    "baselines": self.baselines, "notes": list(self.notes) + list(r.notes),
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
    """The label of a placement priced with K time chunks per recurrent node. The placer splits none
    by default: the MP runtime runs every recurrent layer whole, so by default only that schedule is
    priced; `time_chunks=K` (`--time-chunks K`) prices the time-step wavefront as a what-if."""
    return (f"WHAT-IF (--time-chunks {chunks}): each recurrent layer priced as {chunks} time chunks on a "
            "time-step wavefront; the MP runtime runs each recurrent layer whole, so `train` does not "
            "run this schedule")


FREE_ORDER_NOTE = ("WHAT-IF (free order): priced with each device free to run any ready operation first "
                   "(DLPlacer's schedule); the MP runtime runs every device in program order, so `train` is "
                   "slower than this prediction where the placement needs reordering")


def build_problem(model, cluster: str | Cluster = "dgx1-v100", devices: int = 2, *, batch: int | None = None,
                  coarsen: int | None = None, input_shape=None, dtype: str = "fp32",
                  mem_capacity_bytes: float | None = None, time_chunks: int | None = None,
                  free_order: bool = False, optimizer: str = "momentum",
                  ) -> tuple[PlacementProblem, Graph, Graph, Cluster, str]:
    """The placement problem of a model; `time_chunks` K >= 2 splits recurrent nodes into K tied time
    chunks, a what-if the runtime does not run (None: the default, off; 0: off). Priced in the MP
    runtime's program order (schedule.program_schedule) unless `free_order` or time chunks ask for a
    free schedule (DLPlacer's, the runtime does not run it: a what-if). `optimizer` (a name of
    hybridpar.cost.memory.OPTIMIZERS) sets the optimizer state each device holds and the update's time.
    The returned coarse graph has one node per task."""
    if devices < 1:
        raise UserError(f"devices must be >= 1, got {devices}", param="devices")
    if optimizer not in OPTIMIZERS:
        raise UserError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}", param="optimizer")
    if coarsen is not None and coarsen < 2:
        raise UserError(f"coarsen must be >= 2 nodes, got {coarsen}", param="coarsen")
    batch = DEFAULT_BATCH if batch is None else batch
    if batch < 1:
        raise UserError(f"batch must be >= 1, got {batch}", param="batch")
    if time_chunks is not None and time_chunks < 0:
        raise UserError(f"time_chunks must be >= 0 (0 = off), got {time_chunks}", param="time_chunks")
    cl = cluster if isinstance(cluster, Cluster) else load_cluster(cluster, devices)
    if devices > cl.gpus_per_node:
        # model parallelism sends activations at every cut: keep the group on one node's links
        raise UserError(f"devices {devices}: an MP group must fit in one node of {cl.name!r} "
                        f"({cl.gpus_per_node} devices)", param="devices")
    fine, name = model_graph(model, batch, input_shape)
    chunks = time_chunks or 0  # off by default (what_if_note)
    coarse = _coarse(fine, coarsen or DEFAULT_COARSEN, chunks if chunks >= 2 else 0)
    prob = problem_from_graph(coarse, fine, cl, tuple(range(devices)), dtype=dtype, optimizer=optimizer,
                              mem_capacity_bytes=mem_capacity_bytes,
                              program_order=not free_order and "time_chunks" not in dict(coarse.meta))
    return prob, coarse, fine, cl, name


def place_model(model, cluster: str | Cluster = "dgx1-v100", devices: int = 2, *, solver: str = "ilp",
                time_limit_s: float = 30.0, batch: int | None = None, coarsen: int | None = None,
                input_shape=None, dtype: str = "fp32", workers: int = 2,
                mem_capacity_bytes: float | None = None, time_chunks: int | None = None,
                seed: int = 0, free_order: bool = False, gap: float | None = None,
                optimizer: str = "momentum") -> PlaceOutcome:
    """Place `model` over `devices` devices (0..devices-1) of `cluster` at `batch` samples per step.

    Returns the placement (solver result with schedule and gap), the one-device step for the speedup,
    every baseline's step, and a Plan (mp=devices, placement keyed by module name). The ILP's answer
    depends only on the inputs, `time_limit_s` (deterministic time), `workers`, `seed` and `gap` (the
    ILP stops within this relative gap of its proven bound; None: ilp.DEFAULT_GAP). Priced in
    the MP runtime's program order; `free_order` prices DLPlacer's free schedule (a labelled what-if)."""
    from hybridpar.search.placer import BASELINES, SOLVERS, solve

    if solver not in SOLVERS:
        raise UserError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    if not math.isfinite(time_limit_s):
        raise UserError(f"time_limit_s must be a finite number > 0, got {time_limit_s}", param="time_limit_s")
    if time_limit_s <= 0:
        raise UserError(f"time_limit_s must be > 0, got {time_limit_s}", param="time_limit_s")
    if gap is not None and not (math.isfinite(gap) and 0.0 <= gap < 1.0):
        raise UserError(f"gap must be >= 0 and < 1, got {gap}", param="gap")
    if isinstance(devices, int) and devices > 0:
        budget.check(f"placement on {devices:,} devices", budget.placer_tables_estimate(devices),
                     "place on fewer devices")
    prob, coarse, fine, cl, name = build_problem(model, cluster, devices, batch=batch, coarsen=coarsen,
                                                 input_shape=input_shape, dtype=dtype,
                                                 mem_capacity_bytes=mem_capacity_bytes, time_chunks=time_chunks,
                                                 free_order=free_order, optimizer=optimizer)
    if solver == "ilp":
        budget.check(f"placement of {len(prob.tasks):,} tasks on {devices:,} devices",
                     budget.placer_ilp_estimate(len(prob.tasks), devices),
                     "coarsen the graph (--coarsen N) or place on fewer devices")
    result = solve(prob.one_rank_busy() if solver == "single" else prob, solver, time_limit_s=time_limit_s,
                   workers=workers, seed=seed, gap=gap)
    baselines: dict[str, float] = {}
    for bname, fn in BASELINES.items():
        with contextlib.suppress(InfeasibleError):  # a baseline that does not fit is left out
            # everything on device 0 computes alone: priced without the group's time share
            baselines[bname] = fn(prob.one_rank_busy() if bname == "single" else prob).step_time_s
    single = baselines.get("single")  # None: does not fit on one device; timed anyway, flagged
    single_time = one_process_step_s(prob)
    bd = result.breakdown
    plan = Plan(model=name, input_shape=list(input_shape) if input_shape else None, cluster=cl.name,
                world_size=devices, batch=DEFAULT_BATCH if batch is None else batch, dp=1, mp=devices,
                placement=placement_by_module(coarse, result.assignment, fine), strategy=f"mp={devices}",
                predicted=Prediction(step_time_s=result.step_time_s, compute_s=bd.compute_s, comm_s=bd.comm_s,
                                     exposed_comm_s=bd.exposed_comm_s, idle_s=bd.idle_s,
                                     memory_bytes=[int(x) for x in result.memory_bytes]),
                notes=[f"placer: {result.solver} ({result.status}"
                       + (f", gap {result.gap:.2%}" if result.gap is not None else "") + ")",
                       f"graph coarsened {len(fine)} -> {len(coarse)} nodes"
                       + (f" ({dict(coarse.meta)['time_chunks']} time chunks per recurrent node)"
                          if "time_chunks" in dict(coarse.meta) else ""),
                       *([what_if_note(dict(coarse.meta)["time_chunks"])] if "time_chunks" in dict(coarse.meta)
                         else [])])
    k = dict(coarse.meta).get("time_chunks", 0)
    notes = ((what_if_note(k),) if k else ()) + ((FREE_ORDER_NOTE,) if free_order and not k else ())
    if notes and not k:
        plan = plan.model_copy(update={"notes": [*plan.notes, *notes]})
    return PlaceOutcome(result, single_time, single is not None, baselines, plan, coarse, len(fine), notes)
