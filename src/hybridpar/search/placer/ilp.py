"""DLPlacer's ILP (Pal et al., IEEE Micro 2019) as a CP-SAT model with optional interval variables.

Variables: x[t,d] (task t on device d; tasks with one tie share these literals); start of each task's
forward and backward; for every task u with consumers and every ordered device pair (a, b), a literal
p[u,a,b] (u on a and some consumer on b) that makes present one optional forward transfer on
links[a][b] and one gradient transfer on links[b][a]. Constraints: one device per task; per-device
memory (tasks + receive buffers); NoOverlap per device (forward and backward intervals) and per link
(transfers); precedence with the transfer delays, exactly the rules of schedule.build_ops. Objective:
the step's makespan. A problem in program order (the MP runtime's: problem.program_order) also fixes
each device's order: its forwards in task order, then its backwards in reverse (`_program_order`);
transfers keep a free order on their link (a relaxation: the answer is replayed in program order, and
called optimal only when that replay meets the proven bound).

Tightening (none of it changes the optimum): identical devices are interchangeable, so a device may
only be used once the device before it is (symmetry breaking); the makespan is bounded below by the
critical path, the total work over M devices and, for graphs that split at articulation nodes, by the
decomposition's proven bound (`decompose.py`: the step is then a sum of independent segments, each
solved exactly per boundary device); the search starts from the best of every baseline and the
decomposition's placement.

Deterministic: the CP-SAT solves stop at a deterministic time budget (work, not wall time), searching
with fixed seeds; `interleave_search` makes several workers deterministic too. The wall-clock limit
is a safety net only (a machine so loaded that it hits it can end a solve earlier).

CP-SAT needs integers: times are in units of `time_unit_s` (default: the one-device step / 50,000,
i.e. 0.002% resolution); durations are rounded to the nearest unit. The returned schedule is the
solver's per-resource order replayed in exact seconds, so reported times carry no rounding.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from hybridpar.errors import InfeasibleError
from hybridpar.search.placer.cpsat import (  # noqa: F401 - canonical, critical_path: this module's API too
    Solved,
    _durations,
    _horizon,
    add_hint,
    build_model,
    canonical,
    canonical_perm,
    critical_path,
    run,
    wall_net,
)
from hybridpar.search.placer.decompose import solve_decomposed
from hybridpar.search.placer.problem import PlacementProblem, fmt_bytes
from hybridpar.search.placer.result import PlacementResult, fits
from hybridpar.search.placer.schedule import Op, Schedule, build_ops, program_schedule, replay, timed
from hybridpar.toposort import topological_order

# The solve stops once its placement is within this share of the proven lower bound (as a MIP solver's
# relative gap): the cost model's own error is ~10x larger, and on Inception-V3 (2 devices) the answer
# found at 1 s of deterministic time was the one still held at 30 s (2 min of wall time here). It is a
# property of the search state, so the answer stays deterministic; 0 searches to a proof or the limit.
DEFAULT_GAP = 0.005
WALL_STOPPED_NOTE = ("the wall-clock safety net stopped the search before its deterministic budget (a very "
                     "busy machine): a quieter run may find a faster placement")
MAX_DECOMPOSE_DEVICES = 8  # segment solves per boundary pair grow as M^2
DECOMPOSE_MAX_SHARE = 0.5  # decompose only when no segment holds more than this share of the tasks


def default_time_unit(problem: PlacementProblem) -> float:
    serial = max(problem.serial_time_s(d) for d in range(problem.num_devices))
    return max(serial / 50_000, 1e-12)


def solve_ilp(problem: PlacementProblem, *, time_limit_s: float = 30.0, hint: PlacementResult | None = None,
              time_unit_s: float | None = None, workers: int = 2, seed: int = 0,
              decompose: bool = True, gap: float = DEFAULT_GAP) -> PlacementResult:
    """Optimal (or best found within the time limit) placement and schedule.

    `hint` (the best baseline's result) warm-starts the search and bounds the horizon; the result is
    never slower than the hint (if the time limit leaves the solver no better schedule, the hint is
    kept). `time_limit_s` is spent as deterministic time (module doc): the same problem, seed and
    worker count give the same answer on a quiet or a busy machine. `decompose`: graphs with
    articulation nodes are first solved segment by segment (decompose.py), for half the time limit;
    that gives a proven lower bound and a warm start, and often the optimum. `gap`: stop once the
    best placement is within this relative gap of the proven bound (DEFAULT_GAP; 0: prove or run out
    of time); the result's status is "optimal" only when proven."""
    if not (math.isfinite(gap) and 0.0 <= gap < 1.0):
        raise ValueError(f"gap must be in [0, 1), got {gap}")
    t0 = time.perf_counter()
    problem.check_capacity()
    unit = time_unit_s or default_time_unit(problem)

    def q(s: float) -> int:
        return round(s / unit)

    m = problem.num_devices
    fdur, bdur, xdur = _durations(problem, q)
    notes: list[str] = []
    # warm starts in integer units, the fastest first
    starts: list[_Start] = []
    if hint is not None:
        a = canonical(problem, hint.assignment)
        ops = build_ops(problem, a, q)
        starts.append(_Start(a, ops, timed(problem, ops), hint.solver))
    lower = critical_path(problem, fdur, bdur)
    polish = float(time_limit_s)  # deterministic seconds for the whole-problem search
    if decompose and 1 < m <= MAX_DECOMPOSE_DEVICES:
        dec = solve_decomposed(problem, q, budget=time_limit_s / 2, seed=seed, max_share=DECOMPOSE_MAX_SHARE)
        if dec is not None:
            polish = time_limit_s / 2
            lower = max(lower, dec.lower)
            if dec.optimal_segments == dec.solves:
                workers = 1  # the bound is tight: what is left is local (side tasks), one worker is quicker
            notes.append(dec.note)
            if dec.assignment is not None and fits(problem, dec.assignment):
                dec = dec.relabelled(canonical_perm(problem, dec.assignment))
                a = dec.assignment
                ops = build_ops(problem, a, q)
                keys = dec.keys(ops)
                starts.append(_Start(a, ops, _replayed(problem, ops, keys), "decomposition"))
    starts.sort(key=lambda s: s.makespan)
    best = starts[0] if starts else None
    if best is not None and best.makespan <= lower:  # the warm start meets the proven bound
        return _finish(problem, hint, best, t0, "optimal", lower * unit, notes)
    if best is not None and best.makespan - lower <= gap * best.makespan:  # already within the gap
        notes.append(f"stopped within the {gap:.2%} gap before the whole-problem search")
        return _finish(problem, hint, best, t0, "feasible", lower * unit, notes)
    horizon = best.makespan if best is not None else _horizon(problem, fdur, bdur, xdur)
    mdl = build_model(problem, q, horizon)
    mdl.md.add(mdl.span >= lower)
    if best is not None:
        add_hint(mdl, problem, best.assignment, best.ops, best.sched)
    sol = run(mdl, problem, det_time=polish, wall_s=wall_net(polish), workers=workers, seed=seed, gap=gap)
    bound = max(sol.bound, lower)
    notes += _wall_notes(sol)
    if sol.assignment is not None:
        ops = build_ops(problem, sol.assignment, q)
        found = _Start(list(sol.assignment), ops, _replayed(problem, ops, [sol.starts[op.name] for op in ops]), "ilp")
        if best is None or found.makespan < best.makespan:
            best = found
    if best is not None:
        # in program order the solve is a relaxation (free transfer order): optimal once the replay meets it
        proven = sol.status == "optimal" and not problem.program_order
        status = "optimal" if proven or best.makespan <= bound else "feasible"
        return _finish(problem, hint, best, t0, status, bound * unit, notes)
    if sol.status == "infeasible":
        raise InfeasibleError(f"{problem.name}: no placement on {m} device(s) fits in memory "
                              f"({fmt_bytes(max(problem.mem_capacity_bytes))} each) once activation "
                              "buffers for cross-device edges are counted")
    raise InfeasibleError(f"{problem.name}: the ILP found no placement within {time_limit_s:g} s "
                          "(raise --time-limit or coarsen more)")


def _wall_notes(sol) -> list[str]:
    """The note of a whole-problem search the wall-clock net ended (none otherwise)."""
    return [WALL_STOPPED_NOTE] if sol.wall_stopped else []


@dataclass
class _Start:
    """A placement and its schedule in the ILP's integer units."""

    assignment: list[int]
    ops: list[Op]
    sched: Schedule
    label: str

    @property
    def makespan(self) -> int:
        return int(self.sched.makespan)


def _finish(problem: PlacementProblem, hint: PlacementResult | None, best: _Start, t0: float, status: str,
            bound_s: float | None, notes: list[str]) -> PlacementResult:
    """The schedule in exact seconds (the integer schedule's order on every resource, replayed); the
    baseline's own result when it is faster (the ILP never returns a slower step than its warm start)."""
    elapsed = time.perf_counter() - t0
    sched = _replayed(problem, build_ops(problem, best.assignment), best.sched.start)
    if best.label not in ("ilp", "decomposition"):
        notes = [*notes, f"ILP kept its warm start ({best.label})"]
    result = PlacementResult(problem, tuple(best.assignment), sched, "ilp", elapsed, status, bound_s, tuple(notes))
    if hint is not None and hint.step_time_s < result.step_time_s:
        return PlacementResult(problem, hint.assignment, hint.schedule, "ilp", elapsed, "feasible", bound_s,
                               (*notes, f"ILP kept its warm start ({hint.solver})"))
    return result


def _replayed(problem: PlacementProblem, ops: Sequence[Op], start: Sequence[float]) -> Schedule:
    """The schedule of `ops` run in the order these starts give (program order when the problem is in
    the runtime's program order: the starts only came from a relaxation of it)."""
    if problem.program_order:
        return program_schedule(ops)
    return replay(ops, _order_by_start(ops, start))


def _order_by_start(ops: Sequence[Op], start: Sequence[float]) -> list[int]:
    """The ops in the order a schedule with these starts runs them: by start, then by end (an op of
    length 0 that starts when another op on its resource starts ran first), then by index. For a
    feasible schedule this order is topological and replays to the same schedule or a shorter one;
    the topological sort only repairs keys that are not a schedule (a joined decomposition's)."""
    key = [(s, s + op.duration, i) for i, (op, s) in enumerate(zip(ops, start))]
    return topological_order([op.preds for op in ops], key=key.__getitem__)
