"""Exact per-layer choice on any DAG, with a per-device memory limit: a MILP solved by HiGHS.

x[v, o] ∈ {0, 1} picks option o of vertex v. Edge costs use the local-marginal linearisation:
y[e, a, b] ≥ 0 with Σ_b y = Σ_{o ∈ a} x[u, o] and Σ_a y = Σ_{o ∈ b} x[v, o], where a and b are classes
of options with identical rows/columns of the edge's cost matrix (options that leave the tensor in the
same distribution), which keeps the edge variables few. With x integral, y is integral at an optimum.
"""

from __future__ import annotations

import numpy as np

from hybridpar.search.layers.sp_dp import ChoiceProblem, Solution

_BIG = 1e30  # stands for inf in costs the solver sees (such variables are also fixed to 0)


def _classes(mat: np.ndarray, axis: int) -> np.ndarray:
    """Class id of each row (axis=0) or column (axis=1); equal rows/columns share a class."""
    view = mat if axis == 0 else mat.T
    _, inv = np.unique(np.nan_to_num(view, posinf=_BIG), axis=0, return_inverse=True)
    return inv.reshape(-1)


def solve_ilp(problem: ChoiceProblem, memory_limit: float | None = None,
              time_limit_s: float = 30.0) -> Solution:
    # scipy's optimiser takes most of a second to import: only when a plan needs the MILP
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    offs = np.cumsum([0, *(len(c) for c in problem.node_cost)])
    nx = int(offs[-1])
    xc = np.concatenate(problem.node_cost)
    cost: list[float] = [float(c) if np.isfinite(c) else 0.0 for c in xc]
    upper: list[float] = [1.0 if np.isfinite(c) else 0.0 for c in xc]
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    hi: list[float] = []

    def add_row(entries: list[tuple[int, float]], lb: float, ub: float) -> None:
        r = len(lo)
        for c, v in entries:
            rows.append(r)
            cols.append(c)
            vals.append(v)
        lo.append(lb)
        hi.append(ub)

    for v in range(problem.n):  # exactly one option per vertex
        add_row([(int(offs[v]) + o, 1.0) for o in range(len(problem.node_cost[v]))], 1.0, 1.0)

    for (u, v), mat in zip(problem.edges, problem.edge_cost):
        ra, cb = _classes(mat, 0), _classes(mat, 1)
        na, nb = int(ra.max()) + 1, int(cb.max()) + 1
        rep_r = [int(np.flatnonzero(ra == a)[0]) for a in range(na)]
        rep_c = [int(np.flatnonzero(cb == b)[0]) for b in range(nb)]
        base = len(cost)
        for a in range(na):
            for b in range(nb):
                c = float(mat[rep_r[a], rep_c[b]])
                cost.append(c if np.isfinite(c) else 0.0)
                upper.append(1.0 if np.isfinite(c) else 0.0)
        for a in range(na):  # Σ_b y[a, b] = Σ_{o in a} x[u, o]
            entries = [(base + a * nb + b, 1.0) for b in range(nb)]
            entries += [(int(offs[u]) + o, -1.0) for o in np.flatnonzero(ra == a)]
            add_row(entries, 0.0, 0.0)
        for b in range(nb):
            entries = [(base + a * nb + b, 1.0) for a in range(na)]
            entries += [(int(offs[v]) + o, -1.0) for o in np.flatnonzero(cb == b)]
            add_row(entries, 0.0, 0.0)

    if memory_limit is not None:
        mem = np.concatenate(problem.node_mem)
        add_row([(i, float(m)) for i, m in enumerate(mem) if m], -np.inf, float(memory_limit))

    nvar = len(cost)
    a_mat = coo_matrix((vals, (rows, cols)), shape=(len(lo), nvar)).tocsr()
    integrality = np.zeros(nvar)
    integrality[:nx] = 1
    res = milp(np.asarray(cost), constraints=LinearConstraint(a_mat, lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(nvar), np.asarray(upper)),
               options={"time_limit": time_limit_s, "disp": False})
    if res.x is None:
        raise ValueError(f"no feasible choice ({res.message})")
    x = res.x[:nx]
    choice = tuple(int(np.argmax(x[offs[v]:offs[v + 1]])) for v in range(problem.n))
    method = "ilp" if res.status == 0 else f"ilp (stopped: {res.message})"
    return Solution(choice, problem.cost(choice), problem.memory(choice), method)


def solve(problem: ChoiceProblem, memory_limit: float | None = None) -> Solution:
    """Exact DP when the graph is series-parallel and the memory limit is not binding, else the ILP."""
    from hybridpar.search.layers.sp_dp import NotSeriesParallel, solve_sp

    try:
        sol = solve_sp(problem)
    except NotSeriesParallel:
        return solve_ilp(problem, memory_limit)
    if memory_limit is None or sol.memory <= memory_limit:
        return sol
    return solve_ilp(problem, memory_limit)
