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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from hybridpar.errors import InfeasibleError
from hybridpar.search.placer.problem import PlacementProblem, fmt_bytes
from hybridpar.search.placer.result import PlacementResult, fits
from hybridpar.search.placer.schedule import Op, Schedule, build_ops, program_schedule, replay, timed
from hybridpar.toposort import topological_order

# The time limit is CP-SAT's deterministic time (work, calibrated to about a second of one core), so
# that a busy machine gives the same answer later rather than a different one. Wall-clock safety net:
# the whole solve stops after WALL_MARGIN x the limit whatever the deterministic time says.
WALL_MARGIN = 2.0
WALL_SLACK_S = 10.0
INTERLEAVE = True  # several workers search in deterministic interleaved batches
# The solve stops once its placement is within this share of the proven lower bound (as a MIP solver's
# relative gap): the cost model's own error is ~10x larger, and on Inception-V3 (2 devices) the answer
# found at 1 s of deterministic time was the one still held at 30 s (2 min of wall time here). It is a
# property of the search state, so the answer stays deterministic; 0 searches to a proof or the limit.
DEFAULT_GAP = 0.005
MAX_DECOMPOSE_DEVICES = 8  # segment solves per boundary pair grow as M^2
DECOMPOSE_MAX_SHARE = 0.5  # decompose only when no segment holds more than this share of the tasks


def default_time_unit(problem: PlacementProblem) -> float:
    serial = max(problem.serial_time_s(d) for d in range(problem.num_devices))
    return max(serial / 50_000, 1e-12)


@dataclass
class _Model:
    """A CP-SAT model of one placement problem and the variables the hint and the replay read."""

    md: cp_model.CpModel
    x: list[list]
    sf: list
    sb: list
    pres: dict
    tf: dict
    tb: dict
    span: cp_model.IntVar
    fdur: list[list[int]]
    ps: dict = None  # (u, a, b) -> start of the sender's post of send:u@b (problems with post_time_s)
    gs: dict = None  # (u, a, b) -> start of device b's post of grad:u@b


@dataclass
class Solved:
    """One CP-SAT solve: status name, integer objective and proven bound, assignment, op starts."""

    status: str  # "optimal" | "feasible" | "infeasible" | "unknown"
    objective: int | None
    bound: int
    assignment: tuple[int, ...] | None
    starts: dict[str, int]


def _durations(problem: PlacementProblem, q: Callable[[float], int]):
    n, m = len(problem.tasks), problem.num_devices
    fdur = [[q(t.fwd_s[d]) for d in range(m)] for t in problem.tasks]
    bdur = [[q(t.bwd_s[d]) for d in range(m)] for t in problem.tasks]
    xdur = {(u, a, b): q(problem.transfer_s(problem.tasks[u].out_bytes, a, b))
            for u in range(n) for a in range(m) for b in range(m) if a != b}
    return fdur, bdur, xdur


def _horizon(problem: PlacementProblem, fdur, bdur, xdur) -> int:
    n, m = len(problem.tasks), problem.num_devices
    return sum(max(f) + max(b) for f, b in zip(fdur, bdur)) + 2 * sum(
        max((xdur[(u, a, b)] for a in range(m) for b in range(m) if a != b), default=0) for u in range(n))


def critical_path(problem: PlacementProblem, fdur, bdur) -> int:
    """Longest forward-then-backward chain with every task on its fastest device and no transfers, a
    lower bound on every step: a task's forward follows its inputs' forwards, its backward follows its
    own forward and precedes its inputs' backwards."""
    n = len(problem.tasks)
    head = [0] * n  # longest chain of forwards ending with t's
    after = [0] * n  # longest chain of backwards starting with t's
    for t in range(n):
        head[t] = min(fdur[t]) + max((head[u] for u in problem.preds[t]), default=0)
        after[t] = min(bdur[t]) + max((after[u] for u in problem.preds[t]), default=0)
    return max((head[t] + after[t] for t in range(n)), default=0)


def build_model(problem: PlacementProblem, q: Callable[[float], int], horizon: int,
                fixed: Mapping[int, int] | None = None, symmetry: bool = True) -> _Model:
    """The CP-SAT model; `fixed` pins tasks to devices (the decomposition's boundary tasks)."""
    n, m = len(problem.tasks), problem.num_devices
    S = problem.succs
    fdur, bdur, xdur = _durations(problem, q)
    fixed = dict(fixed or {})
    md = cp_model.CpModel()
    # tied tasks (time chunks of one module) share their device literals: one assignment, several
    # schedule slots
    root = problem.tie_root
    x: list[list] = []
    for t in range(n):
        if root[t] == t:
            x.append([md.new_bool_var(f"x{t}_{d}") for d in range(m)])
            md.add_exactly_one(x[t])
        else:
            x.append(x[root[t]])
    for t, d in fixed.items():
        md.add(x[t][d] == 1)
    if symmetry and not fixed and problem.devices_interchangeable and n and m > 1:
        _break_symmetry(md, problem, x)
    sf = [md.new_int_var(0, horizon, f"sf{t}") for t in range(n)]
    sb = [md.new_int_var(0, horizon, f"sb{t}") for t in range(n)]
    ef = [sf[t] + sum(fdur[t][d] * x[t][d] for d in range(m)) for t in range(n)]
    eb = [sb[t] + sum(bdur[t][d] * x[t][d] for d in range(m)) for t in range(n)]
    on_dev: list[list] = [[] for _ in range(m)]
    on_link: dict[str, list] = {}
    for t in range(n):
        for d in range(m):
            on_dev[d].append(md.new_optional_fixed_size_interval_var(sf[t], fdur[t][d], x[t][d], f"F{t}_{d}"))
            on_dev[d].append(md.new_optional_fixed_size_interval_var(sb[t], bdur[t][d], x[t][d], f"B{t}_{d}"))

    mem_terms: list[list] = [[problem.tasks[t].mem_bytes * x[t][d] for t in range(n)] for d in range(m)]
    pres: dict[tuple[int, int, int], cp_model.IntVar] = {}
    tf: dict[tuple[int, int, int], cp_model.IntVar] = {}
    tb: dict[tuple[int, int, int], cp_model.IntVar] = {}
    ps: dict[tuple[int, int, int], cp_model.IntVar] = {}
    gs: dict[tuple[int, int, int], cp_model.IntVar] = {}
    for u in range(n):
        if not S[u]:
            continue
        for a in range(m):
            for b in range(m):
                if a == b:
                    continue
                k = (u, a, b)
                p = pres[k] = md.new_bool_var(f"p{u}_{a}_{b}")
                md.add_implication(p, x[u][a])
                md.add_bool_or([x[v][b] for v in S[u]]).only_enforce_if(p)
                for v in S[u]:
                    md.add_bool_or([p, x[u][a].Not(), x[v][b].Not()])
                tf[k] = md.new_int_var(0, horizon, f"tf{u}_{a}_{b}")
                tb[k] = md.new_int_var(0, horizon, f"tb{u}_{a}_{b}")
                fwd_iv = md.new_optional_fixed_size_interval_var(tf[k], xdur[(u, a, b)], p, f"XF{u}_{a}_{b}")
                bwd_iv = md.new_optional_fixed_size_interval_var(tb[k], xdur[(u, b, a)], p, f"XB{u}_{a}_{b}")
                for link in problem.links[a][b]:
                    on_link.setdefault(link, []).append(fwd_iv)
                for link in problem.links[b][a]:
                    on_link.setdefault(link, []).append(bwd_iv)
                mem_terms[b].append(problem.tasks[u].out_bytes * p)
                md.add(tf[k] >= ef[u])
                md.add(sb[u] >= tb[k] + xdur[(u, b, a)]).only_enforce_if(p)
                pdur = q(problem.post_time_s(problem.tasks[u].out_bytes))
                if pdur > 0:  # the sender posts the transfer (busy), then it travels; likewise the gradient
                    ps[k] = md.new_int_var(0, horizon, f"ps{u}_{a}_{b}")
                    gs[k] = md.new_int_var(0, horizon, f"gs{u}_{a}_{b}")
                    on_dev[a].append(md.new_optional_fixed_size_interval_var(ps[k], pdur, p, f"P{u}_{a}_{b}"))
                    on_dev[b].append(md.new_optional_fixed_size_interval_var(gs[k], pdur, p, f"G{u}_{a}_{b}"))
                    md.add(ps[k] >= ef[u]).only_enforce_if(p)
                    md.add(tf[k] >= ps[k] + pdur).only_enforce_if(p)
                    md.add(tb[k] >= gs[k] + pdur).only_enforce_if(p)
                    for v in S[u]:
                        md.add(gs[k] >= eb[v]).only_enforce_if([x[u][a], x[v][b]])
                for v in S[u]:
                    md.add(sf[v] >= tf[k] + xdur[(u, a, b)]).only_enforce_if([x[u][a], x[v][b]])
                    md.add(tb[k] >= eb[v]).only_enforce_if([x[u][a], x[v][b]])
    for d in range(m):
        md.add_no_overlap(on_dev[d])
        md.add(sum(mem_terms[d]) <= problem.mem_capacity_bytes[d])
    for ivs in on_link.values():
        md.add_no_overlap(ivs)
    span = md.new_int_var(0, horizon, "makespan")
    # redundant bounds (implied by the rest, but they tighten the relaxation and the gap): per-device
    # load, total work over m devices, the critical path
    loads = [sum((fdur[t][d] + bdur[t][d]) * x[t][d] for t in range(n)) for d in range(m)]
    for d in range(m):
        md.add(loads[d] <= span)
    md.add(sum(loads) <= m * span)
    md.add(span >= critical_path(problem, fdur, bdur))
    md.add(m * span >= sum(min(f[d] + b[d] for d in range(m)) for f, b in zip(fdur, bdur)))
    if m > 1 and all(len(set(f)) == 1 and len(set(b)) == 1 for f, b in zip(fdur, bdur)):
        # identical devices: all compute, whatever its device, fits in m parallel machines
        # (redundant cumulative: lets CP-SAT reason about energy across devices)
        master = [md.new_fixed_size_interval_var(sf[t], fdur[t][0], f"F{t}") for t in range(n)]
        master += [md.new_fixed_size_interval_var(sb[t], bdur[t][0], f"B{t}") for t in range(n)]
        md.add_cumulative(master, [1] * len(master), m)
    for t in range(n):
        md.add(sb[t] >= ef[t])
        for u in problem.preds[t]:
            md.add(sf[t] >= ef[u])
            md.add(sb[u] >= eb[t])
        md.add(span >= eb[t])
    if problem.program_order:
        _program_order(md, problem, x, sf, sb, ef, eb, horizon)
    md.minimize(span)
    return _Model(md, x, sf, sb, pres, tf, tb, span, fdur, ps, gs)


def _program_order(md: cp_model.CpModel, problem: PlacementProblem, x, sf, sb, ef, eb, horizon: int) -> None:
    """The MP runtime's order on every device (schedule.program_schedule): two tasks on one device run
    their forwards in task order and their backwards in reverse (only pairs with no path between them
    need it: a path orders them already), and a device starts its first backward after its last
    forward."""
    n, m = len(problem.tasks), problem.num_devices
    anc = [0] * n  # ancestors as bit masks (tasks are in topological order)
    for t in range(n):
        for u in problem.preds[t]:
            anc[t] |= anc[u] | (1 << u)
    for d in range(m):
        fwd_done = md.new_int_var(0, horizon, f"fwd_done{d}")
        for t in range(n):
            md.add(fwd_done >= ef[t]).only_enforce_if(x[t][d])
            md.add(sb[t] >= fwd_done).only_enforce_if(x[t][d])
    for v in range(n):
        for u in range(v):
            if anc[v] >> u & 1:
                continue
            for d in range(m):
                md.add(sf[v] >= ef[u]).only_enforce_if([x[u][d], x[v][d]])
                md.add(sb[u] >= eb[v]).only_enforce_if([x[u][d], x[v][d]])


def _break_symmetry(md: cp_model.CpModel, problem: PlacementProblem, x: list[list]) -> None:
    """Interchangeable devices: any placement can be relabelled so that devices are first used in
    order 0, 1, 2, ... along the task order (`canonical`), so the model admits only that labelling:
    the first task is on device 0, and a task may be on device d > 0 only if an earlier task is on
    device d-1. This removes all M! relabellings of each placement (for M = 2 it pins one task)."""
    m = problem.num_devices
    roots = [t for t in range(len(problem.tasks)) if problem.tie_root[t] == t]
    md.add(x[roots[0]][0] == 1)
    used: list = [x[roots[0]][d] for d in range(m)]  # used[d]: some task so far is on device d
    for i, t in enumerate(roots[1:], start=1):
        for d in range(1, m):
            md.add_implication(x[t][d], used[d - 1])
        if i == len(roots) - 1 or m == 2:
            continue
        nxt = []
        for d in range(m):
            u = md.new_bool_var(f"used{i}_{d}")
            md.add_bool_or([used[d], x[t][d]]).only_enforce_if(u)  # u only if truly used
            md.add_implication(used[d], u)
            md.add_implication(x[t][d], u)
            nxt.append(u)
        used = nxt


def canonical_perm(problem: PlacementProblem, assignment: Sequence[int]) -> list[int]:
    """The relabelling (old device -> new) that puts a placement in the form the symmetry breaking
    admits: devices first used in order along the task order. Identity unless devices are
    interchangeable."""
    m = problem.num_devices
    if not (problem.devices_interchangeable and len(assignment)):
        return list(range(m))
    relabel: dict[int, int] = {}
    for t in range(len(assignment)):
        if problem.tie_root[t] == t:
            relabel.setdefault(assignment[t], len(relabel))
    for d in range(m):
        relabel.setdefault(d, len(relabel))
    return [relabel[d] for d in range(m)]


def canonical(problem: PlacementProblem, assignment: Sequence[int]) -> list[int]:
    perm = canonical_perm(problem, assignment)
    return [perm[d] for d in assignment]


def add_hint(mdl: _Model, problem: PlacementProblem, assignment: Sequence[int], ops: Sequence[Op],
             sched: Schedule) -> None:
    md = mdl.md
    m = problem.num_devices
    for t, d in enumerate(assignment):
        if problem.tie_root[t] != t:
            continue  # a tied task shares its root's literals (hinting them twice invalidates the model)
        for e in range(m):
            md.add_hint(mdl.x[t][e], d == e)
    start = {op.name: int(s) for op, s in zip(ops, sched.start)}
    end = {op.name: int(e) for op, e in zip(ops, sched.end)}
    for t, task in enumerate(problem.tasks):
        md.add_hint(mdl.sf[t], start[f"fwd:{task.name}"])
        md.add_hint(mdl.sb[t], start[f"bwd:{task.name}"])
    for (u, a, b), p in mdl.pres.items():
        name = problem.tasks[u].name
        present = assignment[u] == a and f"send:{name}@{b}" in start
        md.add_hint(p, present)
        # absent transfers: any value consistent with the unconditional tf >= ef[u]
        md.add_hint(mdl.tf[(u, a, b)], start[f"send:{name}@{b}"] if present else end[f"fwd:{name}"])
        md.add_hint(mdl.tb[(u, a, b)], start[f"grad:{name}@{b}"] if present else 0)
        if (u, a, b) in mdl.ps:
            md.add_hint(mdl.ps[(u, a, b)], start[f"post:{name}@{b}"] if present else 0)
            md.add_hint(mdl.gs[(u, a, b)], start[f"gpost:{name}@{b}"] if present else 0)
    md.add_hint(mdl.span, int(sched.makespan))


def run(mdl: _Model, problem: PlacementProblem, *, det_time: float, wall_s: float, workers: int,
        seed: int, gap: float = 0.0) -> Solved:
    """Solve with a deterministic budget; read back the assignment and every op's start."""
    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.max_deterministic_time = max(float(det_time), 1e-3)
    prm.max_time_in_seconds = max(float(wall_s), 1e-3)
    prm.num_workers = int(workers)
    prm.random_seed = int(seed)
    prm.relative_gap_limit = float(gap)
    if workers > 1 and INTERLEAVE:
        prm.interleave_search = True  # several workers, one deterministic answer
    status = solver.solve(mdl.md)
    if status == cp_model.MODEL_INVALID:  # a bug in this model, not a property of the problem
        raise RuntimeError(f"DLPlacer ILP model invalid: {mdl.md.validate()}")
    if status == cp_model.INFEASIBLE:
        return Solved("infeasible", None, 0, None, {})
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Solved("unknown", None, max(0, int(solver.best_objective_bound)) if status != cp_model.UNKNOWN
                      else 0, None, {})
    n, m = len(problem.tasks), problem.num_devices
    assignment = tuple(next(d for d in range(m) if solver.value(mdl.x[t][d])) for t in range(n))
    starts: dict[str, int] = {}
    for op in build_ops(problem, assignment):
        t = op.task
        if op.kind == "fwd":
            s = solver.value(mdl.sf[t])
        elif op.kind == "bwd":
            s = solver.value(mdl.sb[t])
        elif op.kind == "send":
            s = solver.value(mdl.tf[(t, assignment[t], op.device)])
        else:  # grad, post, gpost: keyed by the consumer's device in the name
            b = int(op.name.rsplit("@", 1)[1])
            var = {"grad": mdl.tb, "post": mdl.ps, "gpost": mdl.gs}[op.kind]
            s = solver.value(var[(t, assignment[t], b)])
        starts[op.name] = int(s)
    bound = math.ceil(solver.best_objective_bound - 1e-9)
    return Solved("optimal" if status == cp_model.OPTIMAL else "feasible", int(solver.objective_value),
                  bound, assignment, starts)


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
    # wall-clock safety net only: model building is not deterministic time, so allow for it generously
    deadline = t0 + WALL_MARGIN * time_limit_s + WALL_SLACK_S
    if decompose and 1 < m <= MAX_DECOMPOSE_DEVICES:
        from hybridpar.search.placer.decompose import solve_decomposed

        dec = solve_decomposed(problem, q, budget=time_limit_s / 2, seed=seed, deadline=deadline,
                               max_share=DECOMPOSE_MAX_SHARE)
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
    sol = run(mdl, problem, det_time=polish, wall_s=max(deadline - time.perf_counter(), 0.05 * time_limit_s),
              workers=workers, seed=seed, gap=gap)
    bound = max(sol.bound, lower)
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
