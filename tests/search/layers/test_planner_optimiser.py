"""The DP and ILP optimisers equal exhaustive search on small chains, residual graphs and DAGs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpar.search.layers.layout_ilp import solve, solve_ilp
from hybridpar.search.layers.sp_dp import ChoiceProblem, NotSeriesParallel, solve_exhaustive, solve_sp


def _problem(n_opts: list[int], edges: list[tuple[int, int]], seed: int, inf_frac: float = 0.1) -> ChoiceProblem:
    rng = np.random.default_rng(seed)
    costs = []
    for k in n_opts:
        c = rng.uniform(0, 10, k)
        c[rng.random(k) < inf_frac] = np.inf
        c[rng.integers(k)] = rng.uniform(0, 10)  # at least one feasible option
        costs.append(c)
    mems = [rng.uniform(0, 5, k) for k in n_opts]
    ecosts = []
    for u, v in edges:
        m = rng.uniform(0, 5, (n_opts[u], n_opts[v]))
        m[rng.random(m.shape) < inf_frac / 2] = np.inf
        ecosts.append(m)
    return ChoiceProblem(tuple(f"v{i}" for i in range(len(n_opts))), tuple(costs), tuple(mems),
                         tuple(edges), tuple(ecosts))


def _residual_edges(blocks: int, downsample: list[bool]) -> tuple[int, list[tuple[int, int]]]:
    """stem -> [conv a -> conv b -> add (+ shortcut conv or identity)] * blocks -> fc."""
    edges: list[tuple[int, int]] = []
    prev, n = 0, 1
    for b in range(blocks):
        a, c = n, n + 1
        n += 2
        edges += [(prev, a), (a, c)]
        if downsample[b]:
            d = n
            n += 1
            edges += [(prev, d)]
            add = n
            n += 1
            edges += [(c, add), (d, add)]
        else:
            add = n
            n += 1
            edges += [(c, add), (prev, add)]
        prev = add
    edges.append((prev, n))
    return n + 1, sorted(edges, key=lambda e: (e[1], e[0]))


def _check(problem: ChoiceProblem, solver) -> None:
    """The solver's cost equals the exhaustive optimum, or both find the problem infeasible."""
    try:
        ref = solve_exhaustive(problem)
    except ValueError:
        with pytest.raises(ValueError):
            solver(problem)
        return
    sol = solver(problem)
    assert sol.cost == pytest.approx(problem.cost(sol.choice))
    assert sol.cost == pytest.approx(ref.cost, rel=1e-9, abs=1e-9)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=6), st.integers(0, 10_000))
def test_chain_dp_equals_exhaustive(n_opts, seed):
    edges = [(i, i + 1) for i in range(len(n_opts) - 1)]
    problem = _problem(n_opts, edges, seed)
    _check(problem, solve_sp)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=2), st.integers(0, 10_000), st.integers(2, 3))
def test_residual_dp_equals_exhaustive(downsample, seed, k):
    n, edges = _residual_edges(len(downsample), downsample)
    problem = _problem([k] * n, edges, seed)
    _check(problem, solve_sp)


def test_nested_parallel_and_multiple_sources():
    # two inputs, a diamond inside a diamond, and a direct skip edge
    edges = [(0, 2), (1, 2), (2, 3), (2, 4), (3, 5), (4, 5), (2, 6), (5, 7), (6, 7), (2, 7)]
    problem = _problem([2, 2, 3, 2, 3, 2, 2, 3], edges, seed=3)
    _check(problem, solve_sp)


def test_bridge_is_not_series_parallel_and_ilp_is_exact():
    # the Wheatstone bridge: 0->1, 0->2, 1->2, 1->3, 2->3
    edges = [(0, 1), (0, 2), (1, 2), (1, 3), (2, 3)]
    problem = _problem([3, 3, 3, 3], edges, seed=7)
    with pytest.raises(NotSeriesParallel):
        solve_sp(problem)
    _check(problem, solve_ilp)
    assert solve(problem).method.startswith("ilp")


@settings(max_examples=20, deadline=None)
@given(st.integers(3, 7), st.integers(0, 10_000), st.floats(0.2, 0.6))
def test_ilp_equals_exhaustive_on_random_dags(n, seed, density):
    rng = np.random.default_rng(seed)
    edges = [(u, v) for v in range(1, n) for u in range(v) if rng.random() < density or u == v - 1]
    problem = _problem([int(k) for k in rng.integers(1, 4, n)], edges, seed)
    _check(problem, solve_ilp)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.3, 1.0))
def test_memory_limit_is_respected_and_optimal(seed, frac):
    n, edges = _residual_edges(2, [True, False])
    problem = _problem([3] * n, edges, seed, inf_frac=0.0)
    lo = sum(float(m.min()) for m in problem.node_mem)
    hi = sum(float(m.max()) for m in problem.node_mem)
    limit = lo + frac * (hi - lo)
    sol = solve(problem, memory_limit=limit)
    ref = solve_exhaustive(problem, memory_limit=limit)
    assert sol.memory <= limit + 1e-6
    assert sol.cost == pytest.approx(ref.cost, rel=1e-7)
