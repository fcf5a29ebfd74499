"""DLPlacer's ILP (Pal et al., IEEE Micro 2019) as a CP-SAT model with optional interval variables.

Variables: x[t,d] (task t on device d; tasks with one tie share these literals); start of each task's
forward and backward; for every task u with consumers and every ordered device pair (a, b), a literal
p[u,a,b] (u on a and some consumer on b) that makes present one optional forward transfer on
links[a][b] and one gradient transfer on links[b][a]. Constraints: one device per task; per-device
memory (tasks + receive buffers); NoOverlap per device (forward and backward intervals) and per link
(transfers); precedence with the transfer delays, exactly the rules of schedule.build_ops. Objective:
the step's makespan.

CP-SAT needs integers: times are in units of `time_unit_s` (default: the one-device step / 50,000,
i.e. 0.002% resolution); durations are rounded to the nearest unit. The returned schedule is the
solver's per-resource order replayed in exact seconds, so reported times carry no rounding.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ortools.sat.python import cp_model

from hybridpar.errors import InfeasibleError
from hybridpar.search.placer.problem import PlacementProblem, fmt_bytes
from hybridpar.search.placer.result import PlacementResult
from hybridpar.search.placer.schedule import build_ops, list_schedule, replay
from hybridpar.toposort import topological_order


def default_time_unit(problem: PlacementProblem) -> float:
    serial = max(problem.serial_time_s(d) for d in range(problem.num_devices))
    return max(serial / 50_000, 1e-12)


def solve_ilp(problem: PlacementProblem, *, time_limit_s: float = 30.0, hint: PlacementResult | None = None,
              time_unit_s: float | None = None, workers: int = 2, seed: int = 0) -> PlacementResult:
    """Optimal (or best found within the time limit) placement and schedule.

    `hint` (a baseline's result) warm-starts the search and bounds the horizon; the result is never
    slower than the hint (if the time limit leaves the solver no better schedule, the hint is kept)."""
    t0 = time.perf_counter()
    problem.check_capacity()
    unit = time_unit_s or default_time_unit(problem)

    def q(s: float) -> int:
        return round(s / unit)

    n, m = len(problem.tasks), problem.num_devices
    P, S = problem.preds, problem.succs
    fdur = [[q(t.fwd_s[d]) for d in range(m)] for t in problem.tasks]
    bdur = [[q(t.bwd_s[d]) for d in range(m)] for t in problem.tasks]
    xdur = {(u, a, b): q(problem.transfer_s(problem.tasks[u].out_bytes, a, b))
            for u in range(n) for a in range(m) for b in range(m) if a != b}

    hint_ops = hint_sched = None
    hint_assignment = _canonical(problem, hint.assignment) if hint is not None else None
    if hint is not None:
        hint_ops = build_ops(problem, hint_assignment, q)
        hint_sched = list_schedule(hint_ops)
        horizon = int(hint_sched.makespan)
    else:
        horizon = sum(max(f) + max(b) for f, b in zip(fdur, bdur)) + 2 * sum(
            max((xdur[(u, a, b)] for a in range(m) for b in range(m) if a != b), default=0) for u in range(n))

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
    if problem.devices_interchangeable and n:
        # symmetry: any placement can be relabelled so the first task with work is on device 0
        md.add(x[_anchor(problem)][0] == 1)
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
                for v in S[u]:
                    md.add(sf[v] >= tf[k] + xdur[(u, a, b)]).only_enforce_if([x[u][a], x[v][b]])
                    md.add(tb[k] >= eb[v]).only_enforce_if([x[u][a], x[v][b]])
    for d in range(m):
        md.add_no_overlap(on_dev[d])
        md.add(sum(mem_terms[d]) <= problem.mem_capacity_bytes[d])
    for ivs in on_link.values():
        md.add_no_overlap(ivs)
    span = md.new_int_var(0, horizon, "makespan")
    # redundant load bounds (implied by NoOverlap, but they tighten the relaxation and the gap)
    loads = [sum((fdur[t][d] + bdur[t][d]) * x[t][d] for t in range(n)) for d in range(m)]
    for d in range(m):
        md.add(loads[d] <= span)
    md.add(sum(loads) <= m * span)
    if m > 1 and all(len(set(f)) == 1 and len(set(b)) == 1 for f, b in zip(fdur, bdur)):
        # identical devices: all compute, whatever its device, fits in m parallel machines
        # (redundant cumulative: lets CP-SAT reason about energy across devices)
        master = [md.new_fixed_size_interval_var(sf[t], fdur[t][0], f"F{t}") for t in range(n)]
        master += [md.new_fixed_size_interval_var(sb[t], bdur[t][0], f"B{t}") for t in range(n)]
        md.add_cumulative(master, [1] * len(master), m)
    for t in range(n):
        md.add(sb[t] >= ef[t])
        for u in P[t]:
            md.add(sf[t] >= ef[u])
            md.add(sb[u] >= eb[t])
        md.add(span >= eb[t])
    md.minimize(span)

    if hint is not None:
        _add_hint(md, problem, hint_assignment, hint_ops, hint_sched, x, sf, sb, pres, tf, tb, span)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(seed)
    status = solver.solve(md)
    if status == cp_model.MODEL_INVALID:  # a bug in this model, not a property of the problem
        raise RuntimeError(f"DLPlacer ILP model invalid: {md.validate()}")
    elapsed = time.perf_counter() - t0
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        assignment = [next(d for d in range(m) if solver.value(x[t][d])) for t in range(n)]
        result = _replayed(problem, assignment, solver, sf, sb, tf, tb, pres, elapsed,
                           "optimal" if status == cp_model.OPTIMAL else "feasible",
                           solver.best_objective_bound * unit)
        if hint is None or result.step_time_s <= hint.step_time_s:
            return result
    if hint is not None:
        # the solver found nothing better than its warm start in time: keep the hint, with the bound
        bound = solver.best_objective_bound * unit if status != cp_model.UNKNOWN else None
        return PlacementResult(problem, hint.assignment, hint.schedule, "ilp", elapsed, "feasible", bound,
                               (f"ILP kept its warm start ({hint.solver})",))
    if status == cp_model.INFEASIBLE:
        raise InfeasibleError(f"{problem.name}: no placement on {m} device(s) fits in memory "
                              f"({fmt_bytes(max(problem.mem_capacity_bytes))} each) once activation "
                              "buffers for cross-device edges are counted")
    raise InfeasibleError(f"{problem.name}: the ILP found no placement within {time_limit_s:g} s "
                          "(raise --time-limit or coarsen more)")


def _canonical(problem: PlacementProblem, assignment: Sequence[int]) -> list[int]:
    """Relabel devices so the anchor task is on device 0 (matches the symmetry-breaking constraint)."""
    a = list(assignment)
    k = _anchor(problem) if a else 0
    if problem.devices_interchangeable and a and a[k] != 0:
        swap = {0: a[k], a[k]: 0}
        a = [swap.get(d, d) for d in a]
    return a


def _anchor(problem: PlacementProblem) -> int:
    """The first task that does work (graph inputs cost nothing and may sit anywhere)."""
    return next((i for i, t in enumerate(problem.tasks) if max(t.fwd_s) + max(t.bwd_s) > 0), 0)


def _add_hint(md, problem, assignment, ops, sched, x, sf, sb, pres, tf, tb, span) -> None:
    m = problem.num_devices
    for t, d in enumerate(assignment):
        if problem.tie_root[t] != t:
            continue  # a tied task shares its root's literals (hinting them twice invalidates the model)
        for e in range(m):
            md.add_hint(x[t][e], d == e)
    start = {op.name: int(s) for op, s in zip(ops, sched.start)}
    end = {op.name: int(e) for op, e in zip(ops, sched.end)}
    for t, task in enumerate(problem.tasks):
        md.add_hint(sf[t], start[f"fwd:{task.name}"])
        md.add_hint(sb[t], start[f"bwd:{task.name}"])
    for (u, a, b), p in pres.items():
        name = problem.tasks[u].name
        present = assignment[u] == a and f"send:{name}@{b}" in start
        md.add_hint(p, present)
        # absent transfers: any value consistent with the unconditional tf >= ef[u]
        md.add_hint(tf[(u, a, b)], start[f"send:{name}@{b}"] if present else end[f"fwd:{name}"])
        md.add_hint(tb[(u, a, b)], start[f"grad:{name}@{b}"] if present else 0)
    md.add_hint(span, int(sched.makespan))


def _replayed(problem, assignment, solver, sf, sb, tf, tb, pres, elapsed, status, bound_s) -> PlacementResult:
    """Exact-seconds schedule with the solver's order on every device and link."""
    ops = build_ops(problem, assignment)
    key: list[tuple[int, int]] = []
    for i, op in enumerate(ops):
        t = op.task
        if op.kind == "fwd":
            s = solver.value(sf[t])
        elif op.kind == "bwd":
            s = solver.value(sb[t])
        elif op.kind == "send":
            s = solver.value(tf[(t, assignment[t], op.device)])
        else:
            src = int(op.name.rsplit("@", 1)[1])
            s = solver.value(tb[(t, assignment[t], src)])
        key.append((s, i))
    order = _topological_by(ops, key)
    return PlacementResult(problem, tuple(assignment), replay(ops, order), "ilp", elapsed, status, bound_s)


def _topological_by(ops, key: Sequence[tuple[int, int]]) -> list[int]:
    """Ops sorted by solver start; zero-length ops can tie with their successors, so repair to a
    topological order while keeping the solver's sequence otherwise."""
    return topological_order([op.preds for op in ops], key=key.__getitem__)
