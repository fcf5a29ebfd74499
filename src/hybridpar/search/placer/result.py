"""A solved placement: assignment, its timed schedule, and how it was found."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from hybridpar.search.placer.problem import PlacementProblem
from hybridpar.search.placer.schedule import Breakdown, Schedule, breakdown, build_ops, timed


def memory_per_device(problem: PlacementProblem, assignment: Sequence[int]) -> list[int]:
    """Resident bytes per device: its tasks' memory plus a buffer for every activation it receives."""
    mem = [0] * problem.num_devices
    for u, t in enumerate(problem.tasks):
        mem[assignment[u]] += t.mem_bytes
        for b in {assignment[v] for v in problem.succs[u]} - {assignment[u]}:
            mem[b] += t.out_bytes
    return mem


def fits(problem: PlacementProblem, assignment: Sequence[int]) -> bool:
    return all(m <= c for m, c in zip(memory_per_device(problem, assignment), problem.mem_capacity_bytes))


@dataclass(frozen=True)
class PlacementResult:
    problem: PlacementProblem
    assignment: tuple[int, ...]
    schedule: Schedule
    solver: str
    solve_time_s: float = 0.0
    status: str = "heuristic"  # "optimal" | "feasible" | "heuristic"
    bound_s: float | None = None  # proven lower bound on the step time (ILP only)
    notes: tuple[str, ...] = ()

    @property
    def step_time_s(self) -> float:
        """The schedule's makespan plus the runtime's fixed costs per step (problem.step_overhead_s,
        problem.update_call_s)."""
        return self.schedule.makespan + self.problem.step_overhead_s + self.problem.update_call_s

    @property
    def gap(self) -> float | None:
        """Relative optimality gap (step - bound) / step; None when no bound was proven."""
        span = self.schedule.makespan  # the bound is on the makespan
        if self.bound_s is None or span <= 0:
            return None
        return max(0.0, (span - self.bound_s) / span)

    @cached_property
    def breakdown(self) -> Breakdown:
        """The schedule's breakdown; the runtime's fixed cost per step (its loss allreduce) counts as
        an exposed transfer after the schedule."""
        bd = breakdown(self.schedule, self.problem.num_devices)
        o, u = self.problem.step_overhead_s, self.problem.update_call_s
        if not o and not u:
            return bd
        return dataclasses.replace(bd, step_s=bd.step_s + o + u, compute_s=bd.compute_s + u,
                                   exposed_comm_s=bd.exposed_comm_s + o, comm_s=bd.comm_s + o,
                                   idle_s=bd.idle_s + o, busy_s=tuple(b + u for b in bd.busy_s))

    @cached_property
    def memory_bytes(self) -> list[int]:
        return memory_per_device(self.problem, self.assignment)

    @property
    def devices_used(self) -> int:
        return len(set(self.assignment))


def evaluate(problem: PlacementProblem, assignment: Sequence[int], solver: str, **kw) -> PlacementResult:
    """Time a placement (how every baseline is costed): in the runtime's program order when the problem
    says so, else with the list scheduler."""
    sched = timed(problem, build_ops(problem, assignment))
    return PlacementResult(problem, tuple(assignment), sched, solver, **kw)
