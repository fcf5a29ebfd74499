"""The CP-SAT model of one placement problem (ilp.py's DLPlacer ILP) and its solve.

Shared by the whole-problem search (ilp.solve_ilp) and the segment solves of the decomposition
(decompose.solve_decomposed), so neither imports the other. The model's variables and constraints
are described in ilp.py's module docstring.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from hybridpar.search.placer.problem import PlacementProblem
from hybridpar.search.placer.schedule import Op, Schedule, build_ops

INTERLEAVE = True  # several workers search in deterministic interleaved batches

# Every solve stops at a deterministic time budget (work, calibrated to about a second of one core), so
# that a busy machine gives the same answer later rather than a different one. The wall-clock limit of
# each solve is a safety net against a runaway solve only, and must stay clear of what a busy machine
# needs: on this 2-core CPU a 3 s budget took up to 16 s of wall time quiet (ratios 3-5x, the clock
# overshooting in phases it cannot interrupt) and 37 s beside one busy core; a 2x net shared by the
# whole placement (decomposition's solves, then the whole-problem search) cut GNMT's 4-GPU search
# short under CI's second test worker and printed another placement (1.61x vs 1.81x, 2026-12-03).
WALL_MARGIN = 12.0
WALL_SLACK_S = 30.0


def wall_net(det_s: float) -> float:
    """The wall-clock safety net of one solve with `det_s` deterministic seconds."""
    return WALL_MARGIN * det_s + WALL_SLACK_S


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
    wall_stopped: bool = False  # the wall-clock net, not the deterministic budget, ended an unproven search


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
    fdur, bdur, xdur = _durations(problem, q)
    fixed = dict(fixed or {})
    md = cp_model.CpModel()
    x = _assignment(md, problem)
    for t, d in fixed.items():
        md.add(x[t][d] == 1)
    if symmetry and not fixed and problem.devices_interchangeable and n and m > 1:
        _break_symmetry(md, problem, x)
    sf = [md.new_int_var(0, horizon, f"sf{t}") for t in range(n)]
    sb = [md.new_int_var(0, horizon, f"sb{t}") for t in range(n)]
    mdl = _Model(md, x, sf, sb, {}, {}, {}, None, fdur, {}, {})  # the makespan after the transfers' variables
    ef = [sf[t] + sum(fdur[t][d] * x[t][d] for d in range(m)) for t in range(n)]
    eb = [sb[t] + sum(bdur[t][d] * x[t][d] for d in range(m)) for t in range(n)]
    on_dev: list[list] = [[] for _ in range(m)]
    for t in range(n):
        for d in range(m):
            on_dev[d].append(md.new_optional_fixed_size_interval_var(sf[t], fdur[t][d], x[t][d], f"F{t}_{d}"))
            on_dev[d].append(md.new_optional_fixed_size_interval_var(sb[t], bdur[t][d], x[t][d], f"B{t}_{d}"))
    mem_terms: list[list] = [[problem.tasks[t].mem_bytes * x[t][d] for t in range(n)] for d in range(m)]
    on_link: dict[str, list] = {}
    for u in range(n):
        for a in range(m):
            for b in range(m):
                if a != b and problem.succs[u]:
                    _add_transfer(mdl, problem, (u, a, b), (q, xdur, horizon), (ef, eb), (on_dev, on_link, mem_terms))
    for d in range(m):
        md.add_no_overlap(on_dev[d])
        md.add(sum(mem_terms[d]) <= problem.mem_capacity_bytes[d])
    for ivs in on_link.values():
        md.add_no_overlap(ivs)
    mdl.span = md.new_int_var(0, horizon, "makespan")
    _add_bounds(mdl, problem, bdur, (ef, eb))
    if problem.program_order:
        _program_order(md, problem, x, sf, sb, ef, eb, horizon)
    md.minimize(mdl.span)
    return mdl


def _assignment(md: cp_model.CpModel, problem: PlacementProblem) -> list[list]:
    """x[t][d]: task t on device d, exactly one per task. Tied tasks (time chunks of one module) share
    their device literals: one assignment, several schedule slots."""
    root = problem.tie_root
    x: list[list] = []
    for t in range(len(problem.tasks)):
        if root[t] == t:
            x.append([md.new_bool_var(f"x{t}_{d}") for d in range(problem.num_devices)])
            md.add_exactly_one(x[t])
        else:
            x.append(x[root[t]])
    return x


def _add_transfer(mdl: _Model, problem: PlacementProblem, k: tuple[int, int, int], timing, ends, resources) -> None:
    """Task u's output sent from device a to its consumers on device b (k = (u, a, b)): a presence
    literal, the forward transfer on links[a][b] and the gradient back on links[b][a], the receive
    buffer in b's memory, the sender's and receiver's posts where posting takes time, and the
    precedences with u's and its consumers' forwards and backwards. `timing`: (q, xdur, horizon);
    `ends`: (ef, eb); `resources`: (intervals per device, intervals per link, memory terms per device)."""
    md, x, S = mdl.md, mdl.x, problem.succs
    q, xdur, horizon = timing
    ef, eb = ends
    on_dev, on_link, mem_terms = resources
    u, a, b = k
    p = mdl.pres[k] = md.new_bool_var(f"p{u}_{a}_{b}")
    md.add_implication(p, x[u][a])
    md.add_bool_or([x[v][b] for v in S[u]]).only_enforce_if(p)
    for v in S[u]:
        md.add_bool_or([p, x[u][a].Not(), x[v][b].Not()])
    tf = mdl.tf[k] = md.new_int_var(0, horizon, f"tf{u}_{a}_{b}")
    tb = mdl.tb[k] = md.new_int_var(0, horizon, f"tb{u}_{a}_{b}")
    fwd_iv = md.new_optional_fixed_size_interval_var(tf, xdur[(u, a, b)], p, f"XF{u}_{a}_{b}")
    bwd_iv = md.new_optional_fixed_size_interval_var(tb, xdur[(u, b, a)], p, f"XB{u}_{a}_{b}")
    for link in problem.links[a][b]:
        on_link.setdefault(link, []).append(fwd_iv)
    for link in problem.links[b][a]:
        on_link.setdefault(link, []).append(bwd_iv)
    mem_terms[b].append(problem.tasks[u].out_bytes * p)
    md.add(tf >= ef[u])
    md.add(mdl.sb[u] >= tb + xdur[(u, b, a)]).only_enforce_if(p)
    pdur = q(problem.post_time_s(problem.tasks[u].out_bytes))
    if pdur > 0:  # the sender posts the transfer (busy), then it travels; likewise the gradient
        ps = mdl.ps[k] = md.new_int_var(0, horizon, f"ps{u}_{a}_{b}")
        gs = mdl.gs[k] = md.new_int_var(0, horizon, f"gs{u}_{a}_{b}")
        on_dev[a].append(md.new_optional_fixed_size_interval_var(ps, pdur, p, f"P{u}_{a}_{b}"))
        on_dev[b].append(md.new_optional_fixed_size_interval_var(gs, pdur, p, f"G{u}_{a}_{b}"))
        md.add(ps >= ef[u]).only_enforce_if(p)
        md.add(tf >= ps + pdur).only_enforce_if(p)
        md.add(tb >= gs + pdur).only_enforce_if(p)
        for v in S[u]:
            md.add(gs >= eb[v]).only_enforce_if([x[u][a], x[v][b]])
    for v in S[u]:
        md.add(mdl.sf[v] >= tf + xdur[(u, a, b)]).only_enforce_if([x[u][a], x[v][b]])
        md.add(tb >= eb[v]).only_enforce_if([x[u][a], x[v][b]])


def _add_bounds(mdl: _Model, problem: PlacementProblem, bdur: list[list[int]], ends) -> None:
    """Precedence between tasks, the makespan over every backward, and redundant bounds (implied by
    the rest, but they tighten the relaxation and the gap): per-device load, total work over m
    devices, the critical path, and for identical devices a cumulative over all compute."""
    md, x, sf, sb, span, fdur = mdl.md, mdl.x, mdl.sf, mdl.sb, mdl.span, mdl.fdur
    ef, eb = ends
    n, m = len(problem.tasks), problem.num_devices
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
    # the gap limit ends a search as OPTIMAL, so an unproven stop short of the deterministic budget is the
    # wall net's; the reported wall time is not compared with the limit (with that comparison, a solve CI
    # stopped at a 0.1 s net came back without its note once)
    wall_stopped = (status in (cp_model.FEASIBLE, cp_model.UNKNOWN)
                    and solver.deterministic_time < 0.99 * prm.max_deterministic_time)
    if status == cp_model.MODEL_INVALID:  # a bug in this model, not a property of the problem
        raise RuntimeError(f"DLPlacer ILP model invalid: {mdl.md.validate()}")
    if status == cp_model.INFEASIBLE:
        return Solved("infeasible", None, 0, None, {})
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Solved("unknown", None, max(0, int(solver.best_objective_bound)) if status != cp_model.UNKNOWN
                      else 0, None, {}, wall_stopped)
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
                  bound, assignment, starts, wall_stopped)
