"""The placer's decomposition at articulation tasks: its bound never exceeds the brute-force optimum,
it is the optimum when nothing is off the main path, and the ILP's answer is deterministic."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from tests.search.placer.test_place_ilp import CASES, US, brute_force, exact_schedule, random_problem, tied

from hybridpar.search.placer import PlacementProblem, Task, ilp, solve, uniform_links
from hybridpar.search.placer.decompose import _automorphisms, solve_decomposed, split
from hybridpar.search.placer.ilp import canonical
from hybridpar.search.placer.schedule import build_ops


def diamonds(blocks: int, m: int, seed: int, *, side: bool = False, shared_links: bool = False,
             bw=None) -> PlacementProblem:
    """A chain of blocks, each a fork into 1-3 branches that join again (Inception's shape), with
    optionally a side output hanging off one join (Inception's auxiliary head)."""
    rng = random.Random(seed)
    tasks: list[Task] = []

    def add(name: str, ins: tuple[str, ...]) -> str:
        f, b = rng.randint(1, 12) * US, rng.randint(1, 18) * US
        tasks.append(Task(name, ins, (f,) * m, (b,) * m, 0, rng.randint(1, 10)))
        return name

    head = add("in", ())
    for k in range(blocks):
        branches = []
        for j in range(rng.randint(1, 3)):
            node = add(f"b{k}_{j}", (head,))
            if rng.random() < 0.3:
                node = add(f"b{k}_{j}x", (node,))
            branches.append(node)
        head = add(f"join{k}", tuple(branches))
        if side and k == 0:
            add("aux", (head,))
    bwm, lat, links = uniform_links(m, 1e6)
    if bw is not None:
        bwm = bw
    if shared_links:
        links = tuple(tuple(("bus",) if a != b else () for b in range(m)) for a in range(m))
    return PlacementProblem(f"diamonds{seed}", tuple(tasks), m, (10**9,) * m, bwm, lat, links)


def brute_force_any(problem: PlacementProblem) -> int:
    """Brute force over every assignment (devices not assumed interchangeable)."""
    best = 10**12
    for assignment in itertools.product(range(problem.num_devices), repeat=len(problem.tasks)):
        best = exact_schedule(build_ops(problem, assignment), best)
    return best


def _q(s: float) -> int:
    return round(s / US)


@pytest.mark.parametrize("m,seed", [(2, 0), (2, 1), (2, 2), (3, 3)])
def test_decomposition_is_exact_without_side_tasks(m, seed):
    p = diamonds(2, m, seed, shared_links=seed % 2 == 1)
    if len(p.tasks) > 8:
        p = diamonds(1, m, seed, shared_links=seed % 2 == 1)
    sp = split(p)
    assert sp is not None and not sp.side and len(sp.segments) >= 2
    opt = brute_force(p)
    dec = solve_decomposed(p, _q, budget=20, max_share=1.0)
    assert dec.optimal_segments == dec.solves
    assert dec.lower == opt
    assert dec.upper == opt
    r = solve(p, "ilp", time_unit_s=US, time_limit_s=20, workers=1)
    assert r.status == "optimal" and round(r.step_time_s / US) == opt


@pytest.mark.parametrize("seed", range(4))
def test_decomposition_bound_is_a_bound_with_a_side_output(seed):
    p = diamonds(2, 2, 10 + seed, side=True)
    while len(p.tasks) > 9:  # keep the brute force quick
        p = dataclasses.replace(p, tasks=p.tasks[:-1])
    sp = split(p)
    assert sp is not None
    opt = brute_force(p)
    dec = solve_decomposed(p, _q, budget=20, max_share=1.0)
    assert dec.lower <= opt
    r = solve(p, "ilp", time_unit_s=US, time_limit_s=20, workers=1)
    assert r.status == "optimal" and round(r.step_time_s / US) == opt


def test_decomposition_uses_device_symmetries_exactly():
    # three devices, 0-1 and 1-2 fast, 0-2 slow: swapping 0 and 2 is the only non-trivial symmetry
    bw = tuple(tuple(0.0 if a == b else (2e5 if {a, b} == {0, 2} else 1e6) for b in range(3)) for a in range(3))
    p = diamonds(1, 3, 5, bw=bw)
    assert not p.devices_interchangeable
    assert sorted(_automorphisms(p)) == [(0, 1, 2), (2, 1, 0)]
    opt = brute_force_any(p)
    dec = solve_decomposed(p, _q, budget=20, max_share=1.0)
    assert dec.lower == dec.upper == opt


def test_ties_are_not_decomposed():
    p = tied(random_problem(8, 2, 3), 3)
    assert split(p) is None


def test_canonical_relabels_first_use_in_order():
    p = random_problem(5, 3, 0)
    assert p.devices_interchangeable
    assert canonical(p, [2, 2, 0, 1, 0]) == [0, 0, 1, 2, 1]


@pytest.mark.parametrize("make", [lambda: diamonds(6, 3, 7, side=True), lambda: random_problem(16, 3, 9)])
def test_ilp_answer_is_deterministic(make):
    p = make()
    runs = [solve(p, "ilp", time_unit_s=US, time_limit_s=1.0, workers=2, seed=3) for _ in range(2)]
    assert runs[0].assignment == runs[1].assignment
    assert runs[0].step_time_s == runs[1].step_time_s
    assert runs[0].bound_s == runs[1].bound_s


@pytest.mark.parametrize("n,m,seed", CASES[::3])
def test_ilp_through_the_decomposition_matches_brute_force(n, m, seed, monkeypatch):
    # the solver decomposes only when no segment holds over half the tasks; here it always does
    monkeypatch.setattr(ilp, "DECOMPOSE_MAX_SHARE", 1.0)
    p = random_problem(n, m, seed, shared_links=seed % 2 == 1)
    assert split(p) is not None
    r = solve(p, "ilp", time_unit_s=US, time_limit_s=20, workers=1)
    assert any(note.startswith("decomposition") for note in r.notes)
    assert r.status == "optimal" and round(r.step_time_s / US) == brute_force(p)
