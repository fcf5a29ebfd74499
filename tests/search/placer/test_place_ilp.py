"""The ILP's step time equals a brute-force optimum on small random graphs, and never loses to a baseline."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from hybridpar.errors import InfeasibleError
from hybridpar.search.placer import BASELINES, PlacementProblem, Task, contract, solve, uniform_links
from hybridpar.search.placer.ilp import solve_ilp
from hybridpar.search.placer.result import fits
from hybridpar.search.placer.schedule import build_ops

US = 1e-6  # test times are whole microseconds so the ILP (unit 1 us) has no rounding


def random_problem(n: int, m: int, seed: int, *, mem: int = 10**9, shared_links: bool = False,
                   task_mem: int = 0) -> PlacementProblem:
    rng = random.Random(seed)
    bw, lat, links = uniform_links(m, 1e6)  # 1 byte per us
    if shared_links:  # all transfers share one bus: tests link serialisation
        links = tuple(tuple(("bus",) if a != b else () for b in range(m)) for a in range(m))
    tasks = []
    for i in range(n):
        ins = tuple(f"t{j}" for j in range(i) if rng.random() < 0.4) if i else ()
        if i and not ins:
            ins = (f"t{rng.randrange(i)}",)
        f, b = rng.randint(1, 12) * US, rng.randint(1, 18) * US
        tasks.append(Task(f"t{i}", ins, (f,) * m, (b,) * m, task_mem, rng.randint(1, 10)))
    return PlacementProblem(f"rand{seed}", tuple(tasks), m, (mem,) * m, bw, lat, links)


def exact_schedule(ops, best: int) -> int:
    """Minimum makespan over all semi-active schedules (every order of ops on every resource), by
    depth-first search over topological orders with branch and bound. Integer durations only."""
    n = len(ops)
    dur = [round(op.duration / US) for op in ops]
    succ = [[] for _ in ops]
    for i, op in enumerate(ops):
        for p in op.preds:
            succ[p].append(i)
    tail = [0] * n  # longest path from op i to the end, own duration included
    for i in reversed(range(n)):
        tail[i] = dur[i] + max((tail[s] for s in succ[i]), default=0)
    end = [0] * n
    best_box = [best]

    def dfs(done: int, free: dict, span: int, last: int) -> None:
        if done == (1 << n) - 1:
            best_box[0] = min(best_box[0], span)
            return
        ready = [i for i in range(n) if not done >> i & 1 and all(done >> p & 1 for p in ops[i].preds)]
        est = {i: max([end[p] for p in ops[i].preds] + [free.get(r, 0) for r in ops[i].resources] + [0])
               for i in ready}
        if max([span] + [est[i] + tail[i] for i in ready]) >= best_box[0]:
            return
        for i in ready:
            # orders that only swap adjacent independent ops give the same schedule: keep one
            if (last >= 0 and i < last and last not in ops[i].preds
                    and not set(ops[i].resources) & set(ops[last].resources)):
                continue
            end[i] = est[i] + dur[i]
            new_free = dict(free)
            for r in ops[i].resources:
                new_free[r] = end[i]
            dfs(done | 1 << i, new_free, max(span, end[i]), i)

    dfs(0, {}, 0, -1)
    return best_box[0]


def brute_force(problem: PlacementProblem) -> int:
    best = 10**12
    m = problem.num_devices
    for rest in itertools.product(range(m), repeat=len(problem.tasks) - 1):
        assignment = (0, *rest)  # devices are interchangeable in these problems
        if problem.respects_ties(assignment) and fits(problem, assignment):
            best = exact_schedule(build_ops(problem, assignment), best)
    return best


CASES = ([(5, 2, s) for s in range(3)] + [(6, 3, s) for s in range(3)] + [(8, 2, s) for s in range(2)]
         + [(7, 3, s) for s in range(2)] + [(9, 2, 1)])


@pytest.mark.parametrize("n,m,seed", CASES)
def test_ilp_matches_brute_force(n, m, seed):
    p = random_problem(n, m, seed, shared_links=seed % 2 == 1)
    opt = brute_force(p)
    r = solve(p, "ilp", time_unit_s=US, time_limit_s=20, workers=1)
    assert r.status == "optimal"
    assert round(r.step_time_s / US) == opt
    assert r.gap == pytest.approx(0.0, abs=1e-9)


def tied(problem: PlacementProblem, seed: int, groups: int = 2) -> PlacementProblem:
    """`problem` with `groups` random tie groups of 2-3 tasks (tasks that must share a device)."""
    rng = random.Random(seed)
    names = [t.name for t in problem.tasks]
    rng.shuffle(names)
    tie = {}
    for g in range(groups):
        for name in names[:rng.randint(2, 3)]:
            tie[name] = f"g{g}"
        names = names[3:]
    tasks = tuple(dataclasses.replace(t, tie=tie.get(t.name, "")) for t in problem.tasks)
    return dataclasses.replace(problem, tasks=tasks)


TIE_CASES = [(6, 2, s) for s in range(3)] + [(8, 2, 3), (7, 2, 4), (6, 3, 5), (7, 3, 6)]


@pytest.mark.parametrize("n,m,seed", TIE_CASES)
def test_ilp_matches_brute_force_with_ties(n, m, seed):
    p = tied(random_problem(n, m, seed, shared_links=seed % 2 == 1), seed)
    assert any(t.tie for t in p.tasks)
    opt = brute_force(p)
    r = solve(p, "ilp", time_unit_s=US, time_limit_s=20, workers=1)
    assert r.status == "optimal" and p.respects_ties(r.assignment)
    assert round(r.step_time_s / US) == opt
    # ties only remove placements: the optimum can only rise
    free = solve(dataclasses.replace(p, tasks=tuple(dataclasses.replace(t, tie="") for t in p.tasks)), "ilp",
                 time_unit_s=US, time_limit_s=20, workers=1)
    assert r.step_time_s >= free.step_time_s - 1e-12


@pytest.mark.parametrize("seed", range(4))
def test_baselines_respect_ties(seed):
    p = tied(random_problem(14, 3, 200 + seed, shared_links=True), seed, groups=3)
    for name, fn in BASELINES.items():
        assert p.respects_ties(fn(p).assignment), name
    assert p.respects_ties(solve(p, "ilp", time_limit_s=2, workers=1).assignment)


def test_tied_group_memory_is_reserved_whole():
    # four 40% tasks tied in pairs: each pair fills 80% of a device, so the pairs go apart
    base = random_problem(4, 2, 5, mem=100, task_mem=40)
    tasks = tuple(dataclasses.replace(t, tie=("a" if i < 2 else "b")) for i, t in enumerate(base.tasks))
    p = dataclasses.replace(base, tasks=tasks)
    for solver in ("ilp", "dp", "etf", "greedy"):
        r = solve(p, solver, time_limit_s=5, workers=1)
        assert fits(p, r.assignment) and p.respects_ties(r.assignment), solver
        assert r.assignment[0] == r.assignment[1] != r.assignment[2] == r.assignment[3], solver


def test_exact_schedule_is_exhaustive_on_a_known_case():
    # two independent tasks on one device: fwd a, fwd b, bwd a, bwd b -> 1+2+3+4 = 10 us whatever the order
    p = PlacementProblem("two", (Task("a", (), (1 * US,), (3 * US,)), Task("b", (), (2 * US,), (4 * US,))),
                         1, (1,), *uniform_links(1, 1.0))
    assert exact_schedule(build_ops(p, (0, 0)), 10**9) == 10
    # a chain over two devices pays a transfer each way: 1 + 5 + 2 + 4 + 5 + 3 = 20 us
    bw, lat, links = uniform_links(2, 1e6)
    chain = PlacementProblem("chain", (Task("a", (), (1 * US,) * 2, (3 * US,) * 2, 0, 5),
                                       Task("b", ("a",), (2 * US,) * 2, (4 * US,) * 2, 0, 5)),
                             2, (10**9,) * 2, bw, lat, links)
    assert exact_schedule(build_ops(chain, (0, 1)), 10**9) == 20
    assert brute_force(chain) == 10  # both on one device is better


@pytest.mark.parametrize("seed", range(4))
def test_ilp_never_worse_than_any_baseline(seed):
    p = random_problem(14, 3, 100 + seed, shared_links=True)
    r = solve(p, "ilp", time_limit_s=2, workers=1)
    for name, fn in BASELINES.items():
        assert r.step_time_s <= fn(p).step_time_s * (1 + 1e-9), name


def test_ilp_keeps_warm_start_when_out_of_time():
    p = random_problem(14, 3, 7)
    hint = BASELINES["greedy"](p)
    r = solve_ilp(p, hint=hint, time_limit_s=0.001, workers=1)
    assert r.step_time_s <= hint.step_time_s


def test_replayed_schedule_respects_resources_and_precedence():
    p = random_problem(10, 3, 3, shared_links=True)
    r = solve(p, "ilp", time_limit_s=5, workers=1)
    s = r.schedule
    for i, op in enumerate(s.ops):
        assert all(s.end[q] <= s.start[i] + 1e-15 for q in op.preds)
    by_res: dict[str, list[tuple[float, float]]] = {}
    for op, a, b in zip(s.ops, s.start, s.end):
        for res in op.resources:
            by_res.setdefault(res, []).append((a, b))
    for spans in by_res.values():
        spans.sort()
        assert all(e1 <= s2 + 1e-15 for (_, e1), (s2, _) in itertools.pairwise(spans))
    bd = r.breakdown
    assert bd.compute_s + bd.exposed_comm_s == pytest.approx(r.step_time_s)


@pytest.mark.parametrize("seed", range(4))
def test_coarsening_can_only_raise_the_optimum(seed):
    p = random_problem(8, 2, 20 + seed)
    fine = solve(p, "ilp", time_unit_s=US, workers=1)
    rng = random.Random(seed)
    coarse_p = p
    for _ in range(2):  # merge two producer/consumer pairs; skip pairs whose merge makes a cycle
        edges = [(t.inputs[0], t.name) for t in coarse_p.tasks if t.inputs]
        for u, v in rng.sample(edges, k=len(edges)):
            try:
                coarse_p = contract(coarse_p, [[u, v]])
                break
            except ValueError:
                continue
    assert len(coarse_p.tasks) == len(p.tasks) - 2
    coarse = solve(coarse_p, "ilp", time_unit_s=US, workers=1)
    assert fine.status == coarse.status == "optimal"
    assert coarse.step_time_s >= fine.step_time_s - 1e-12
    assert sum(t.fwd_s[0] + t.bwd_s[0] for t in coarse_p.tasks) == pytest.approx(p.serial_time_s())


def test_memory_capacity_forces_a_split():
    # each task needs 40% of a device: one device cannot hold 4 of them
    p = random_problem(4, 2, 5, mem=100, task_mem=40)
    for solver in ("ilp", "dp", "etf", "greedy"):
        r = solve(p, solver, time_limit_s=5, workers=1)
        assert fits(p, r.assignment), solver
        assert r.devices_used == 2
    with pytest.raises(InfeasibleError, match="one device"):
        solve(p, "single")


def test_memory_infeasible_names_the_bottleneck():
    p = random_problem(3, 2, 5, mem=100, task_mem=120)
    with pytest.raises(InfeasibleError, match="node 't0' alone needs"):
        solve(p, "ilp")
    q = random_problem(6, 2, 5, mem=100, task_mem=40)
    with pytest.raises(InfeasibleError, match="in total"):
        solve(q, "ilp")
