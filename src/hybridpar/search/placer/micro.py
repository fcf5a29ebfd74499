"""GPipe micro-batches over a placement, priced as the MP runtime runs them, and their count chosen.

The runtime (hybridpar.parallel.pipeline.module, `micro_batches` K) cuts each replica's batch into K
micro-batches and runs, on every device, the forwards of micro-batch 0, 1, ..., K-1 in a row (its
sends are non-blocking, so device d runs micro-batch k while device d+1 runs k-1), then one backward
whose autograd order takes the last micro-batch first: K-1, ..., 0. `micro_batch_ops` builds exactly
that program: K copies of `schedule.build_ops` of the problem at one micro-batch (each task's compute
and output bytes / K; the executor's own cost per node, `Task.overhead_s`, and every transfer's
latency paid once per micro-batch: the bubble and the price of cutting), forwards in micro-batch
order, then backwards in reverse, replayed in program order. The fixed costs per step
(step_overhead_s, update_call_s) are paid once, as without micro-batches.

Compute is scaled linearly in the batch, which over-prices the micro-batches' throughput where a
device is not saturated at B/K samples (small batches on a GPU); the choice then leans to fewer."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hybridpar.search.placer.problem import PlacementProblem
from hybridpar.search.placer.schedule import Op, build_ops, program_schedule

MAX_MICRO_BATCHES = 16  # the most the placer tries (each a replay of K x the step's operations)
TIE_REL = 1e-9  # steps within this relative difference are equal (sums of K scaled durations round differently)


def micro_problem(problem: PlacementProblem, k: int) -> PlacementProblem:
    """The problem at one of K micro-batches: compute (less the runtime's per-node cost) and bytes / K."""
    if k == 1:
        return problem

    def scaled(times: tuple[float, ...], fixed: float) -> tuple[float, ...]:
        return tuple(fixed + max(0.0, x - fixed) / k for x in times)

    tasks = tuple(dataclasses.replace(t, fwd_s=scaled(t.fwd_s, t.overhead_s), bwd_s=scaled(t.bwd_s, 0.0),
                                      out_bytes=-(-t.out_bytes // k)) for t in problem.tasks)
    return dataclasses.replace(problem, tasks=tasks)


def micro_batch_ops(problem: PlacementProblem, assignment: Sequence[int], k: int) -> list[Op]:
    """The operations of one step of K micro-batches in the runtime's program order (module doc)."""
    one = build_ops(micro_problem(problem, k), assignment)
    if k == 1:
        return one
    first_bwd = next(i for i, op in enumerate(one) if op.kind in ("bwd", "gpost", "grad"))
    ops: list[Op] = []
    index: dict[tuple[int, int], int] = {}  # (micro-batch, op of `one`) -> position in `ops`

    def add(m: int, i: int) -> None:
        op = one[i]
        preds = tuple(index[(m, p)] for p in op.preds)
        index[(m, i)] = len(ops)
        ops.append(dataclasses.replace(op, name=f"{op.name}#{m}", preds=preds))

    for m in range(k):
        for i in range(first_bwd):
            add(m, i)
    for m in reversed(range(k)):
        for i in range(first_bwd, len(one)):
            add(m, i)
    return ops


def micro_batch_step_s(problem: PlacementProblem, assignment: Sequence[int], k: int) -> float:
    """The predicted step of the placement run with K micro-batches (the runtime's program order)."""
    span = program_schedule(micro_batch_ops(problem, assignment, k)).makespan
    return span + problem.step_overhead_s + problem.update_call_s


def candidate_counts(samples: int, limit: int = MAX_MICRO_BATCHES) -> list[int]:
    """Micro-batch counts worth pricing for `samples` per replica: those that cut it evenly (an
    exported graph needs it; equal pieces keep the pipeline balanced), up to `limit`."""
    return [k for k in range(1, min(samples, limit) + 1) if samples % k == 0]


def choose_micro_batches(problem: PlacementProblem, assignment: Sequence[int], samples: int,
                         limit: int = MAX_MICRO_BATCHES) -> tuple[int, dict[int, float]]:
    """(the count with the shortest predicted step, every candidate's step); ties go to fewer: a count
    must beat every smaller one by more than rounding (TIE_REL) to be chosen, so a placement on one
    device (nothing to overlap) keeps one micro-batch."""
    steps = {k: micro_batch_step_s(problem, assignment, k) for k in candidate_counts(samples, limit)}
    fastest = min(steps.values())
    best = min(k for k, v in steps.items() if v <= fastest * (1 + TIE_REL))
    return best, steps
