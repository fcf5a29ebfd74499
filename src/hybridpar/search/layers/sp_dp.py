"""Per-layer choice problem and its exact optimisers on chains and series-parallel graphs.

A `ChoiceProblem` is a DAG whose vertices each pick one option: option o of vertex v costs
`node_cost[v][o]` seconds and `node_mem[v][o]` bytes per device; an edge (u, v) costs
`edge_cost[e][o_u, o_v]` (redistribution when the two ends disagree). The objective is the sum.
`inf` marks an infeasible option or pair.

Residual networks are series-parallel: a chain of blocks whose branches rejoin. `solve_sp` is exact
on them by dynamic programming: a (source, sink) sub-problem is reduced to a matrix
M[o_source, o_sink] of best interior costs, composed in series through the vertices every path
crosses (min-plus product) and in parallel over the branches between two such vertices (sum).
Graphs that are not series-parallel raise `NotSeriesParallel` (the planner then uses the ILP).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

INF = float("inf")

Assign = dict[int, int]
Recon = Callable[[int, int], Assign]


class NotSeriesParallel(ValueError):
    """The graph has a sub-graph (a 'bridge') that series/parallel composition cannot reduce."""


@dataclass(frozen=True)
class ChoiceProblem:
    names: tuple[str, ...]  # vertices in topological order
    node_cost: tuple[np.ndarray, ...]
    node_mem: tuple[np.ndarray, ...]
    edges: tuple[tuple[int, int], ...]
    edge_cost: tuple[np.ndarray, ...]

    def __post_init__(self) -> None:
        for (u, v), m in zip(self.edges, self.edge_cost, strict=True):
            if not u < v:
                raise ValueError(f"edge {u}->{v} is not in topological order")
            if m.shape != (len(self.node_cost[u]), len(self.node_cost[v])):
                raise ValueError(f"edge {u}->{v}: cost matrix shape {m.shape} does not match the options")

    @property
    def n(self) -> int:
        return len(self.names)

    @cached_property
    def edge_index(self) -> dict[tuple[int, int], int]:
        return {e: i for i, e in enumerate(self.edges)}

    @cached_property
    def preds(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(self.n)]
        for u, v in self.edges:
            out[v].append(u)
        return out

    @cached_property
    def succs(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(self.n)]
        for u, v in self.edges:
            out[u].append(v)
        return out

    def cost(self, choice: Sequence[int]) -> float:
        total = sum(float(self.node_cost[v][o]) for v, o in enumerate(choice))
        return total + sum(float(m[choice[u], choice[v]]) for (u, v), m in zip(self.edges, self.edge_cost))

    def memory(self, choice: Sequence[int]) -> float:
        return sum(float(self.node_mem[v][o]) for v, o in enumerate(choice))


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]
    cost: float
    memory: float
    method: str


def solve_exhaustive(problem: ChoiceProblem, memory_limit: float | None = None) -> Solution:
    """Every combination (reference for tests on small problems)."""
    best: tuple[float, tuple[int, ...]] | None = None
    for choice in itertools.product(*(range(len(c)) for c in problem.node_cost)):
        if memory_limit is not None and problem.memory(choice) > memory_limit:
            continue
        c = problem.cost(choice)
        if c < INF and (best is None or c < best[0]):
            best = (c, choice)
    if best is None:
        raise ValueError("no feasible choice")
    return Solution(best[1], best[0], problem.memory(best[1]), "exhaustive")


def solve_sp(problem: ChoiceProblem) -> Solution:
    """Exact optimum (without a memory limit) of a series-parallel problem."""
    if problem.n == 0:
        raise ValueError("empty problem")
    sources = [v for v in range(problem.n) if not problem.preds[v]]
    sinks = [v for v in range(problem.n) if not problem.succs[v]]
    if len(sources) != 1 or len(sinks) != 1:
        return _solve_with_terminals(problem, sources, sinks)
    s, t = sources[0], sinks[0]
    cs, ct = problem.node_cost[s], problem.node_cost[t]
    if s == t:
        o = int(np.argmin(cs))
        return _solution(problem, (o,))
    solver = _SPSolver(problem)
    mat, recon = solver.between(s, t, frozenset(range(problem.n)) - {s, t}, include_direct=True)
    total = cs[:, None] + mat + ct[None, :]
    i, j = np.unravel_index(int(np.argmin(total)), total.shape)
    if not np.isfinite(total[i, j]):
        raise ValueError("no feasible choice")
    assign = recon(int(i), int(j))
    assign[s], assign[t] = int(i), int(j)
    return _solution(problem, tuple(assign[v] for v in range(problem.n)))


def _solution(problem: ChoiceProblem, choice: tuple[int, ...], method: str = "sp-dp") -> Solution:
    return Solution(choice, problem.cost(choice), problem.memory(choice), method)


def _solve_with_terminals(problem: ChoiceProblem, sources: list[int], sinks: list[int]) -> Solution:
    """Several sources or sinks: add a zero-cost virtual source and sink with one option each."""
    n = problem.n
    zero = np.zeros(1)
    names = ("<source>", *problem.names, "<sink>")
    node_cost = (zero, *problem.node_cost, zero)
    node_mem = (zero, *problem.node_mem, zero)
    edges = [(u + 1, v + 1) for u, v in problem.edges]
    costs = list(problem.edge_cost)
    for s in sources:
        edges.append((0, s + 1))
        costs.append(np.zeros((1, len(problem.node_cost[s]))))
    for t in sinks:
        edges.append((t + 1, n + 1))
        costs.append(np.zeros((len(problem.node_cost[t]), 1)))
    wrapped = ChoiceProblem(names, node_cost, node_mem, tuple(edges), tuple(costs))
    sol = solve_sp(wrapped)
    choice = sol.choice[1:-1]
    return _solution(problem, choice)


def _minplus(a: np.ndarray, mid: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """out[i, j] = min_x a[i, x] + mid[x] + b[x, j], and the argmin x."""
    cube = a[:, :, None] + mid[None, :, None] + b[None, :, :]
    return cube.min(axis=1), np.argmin(cube, axis=1)  # the minimum is the entry at the argmin


_STRUCTURE: dict[tuple, dict] = {}  # (n, edges) -> memo of cuts and components (pure graph structure)


class _SPSolver:
    def __init__(self, problem: ChoiceProblem):
        self.p = problem
        # the planner solves one layer graph many times (every space, every gradient weight): its
        # series/parallel structure is the same each time
        key = (problem.n, problem.edges)
        if key not in _STRUCTURE and len(_STRUCTURE) > 64:
            _STRUCTURE.clear()
        self._memo = _STRUCTURE.setdefault(key, {})

    def between(self, s: int, t: int, interior: frozenset[int], include_direct: bool) -> tuple[np.ndarray, Recon]:
        """Best cost matrix over the interior's vertices and the edges among interior ∪ {s, t}."""
        p = self.p
        direct = p.edge_index.get((s, t)) if include_direct else None
        if not interior:
            if direct is None:
                raise NotSeriesParallel(f"{p.names[s]} and {p.names[t]} are not connected")
            return p.edge_cost[direct], lambda i, j: {}
        cuts = self._cuts(s, t, interior, include_direct)
        if cuts:
            return self._series(s, t, cuts, interior, include_direct)
        comps = self._components(interior)
        if len(comps) == 1 and direct is None:
            raise NotSeriesParallel(f"the sub-graph between {p.names[s]} and {p.names[t]} is not series-parallel")
        parts: list[tuple[np.ndarray, Recon]] = []
        if direct is not None:
            parts.append((p.edge_cost[direct], lambda i, j: {}))
        parts += [self.between(s, t, comp, include_direct=False) for comp in comps]
        total = sum(m for m, _ in parts)

        def recon(i: int, j: int) -> Assign:
            out: Assign = {}
            for _, r in parts:
                out.update(r(i, j))
            return out

        return total, recon

    def _order(self, s: int, t: int, interior: frozenset[int]) -> list[int]:
        return sorted(interior | {s, t})  # vertex indices are topological

    def _edges_within(self, nodes: frozenset[int] | set[int], s: int, t: int, include_direct: bool):
        for u, v in self.p.edges:
            if u in nodes and v in nodes and (include_direct or (u, v) != (s, t)):
                yield u, v

    def _cuts(self, s: int, t: int, interior: frozenset[int], include_direct: bool) -> list[int]:
        """Interior vertices on every s-t path: in topological order, no edge jumps over them."""
        key = ("cuts", s, t, interior, include_direct)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._find_cuts(s, t, interior, include_direct)
        return hit

    def _find_cuts(self, s: int, t: int, interior: frozenset[int], include_direct: bool) -> list[int]:
        order = self._order(s, t, interior)
        pos = {v: k for k, v in enumerate(order)}
        cover = np.zeros(len(order) + 1, dtype=int)
        for u, v in self._edges_within(set(order), s, t, include_direct):
            cover[pos[u] + 1] += 1
            cover[pos[v]] -= 1
        jumped = np.cumsum(cover)
        return [v for k, v in enumerate(order) if 0 < k < len(order) - 1 and jumped[k] == 0]

    def _components(self, interior: frozenset[int]) -> list[frozenset[int]]:
        key = ("components", interior)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._find_components(interior)
        return hit

    def _find_components(self, interior: frozenset[int]) -> list[frozenset[int]]:
        parent = {v: v for v in interior}

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for u, v in self.p.edges:
            if u in interior and v in interior:
                parent[find(u)] = find(v)
        groups: dict[int, set[int]] = {}
        for v in interior:
            groups.setdefault(find(v), set()).add(v)
        return [frozenset(g) for g in groups.values()]

    def _series(self, s: int, t: int, cuts: list[int], interior: frozenset[int],
                include_direct: bool) -> tuple[np.ndarray, Recon]:
        chain = [s, *cuts, t]
        segs = []
        for a, b in itertools.pairwise(chain):
            inner = frozenset(v for v in interior if a < v < b)
            segs.append(self.between(a, b, inner, include_direct=True))
        acc, acc_recon = segs[0]
        for cut, (mat, rec) in zip(cuts, segs[1:]):
            new, arg = _minplus(acc, self.p.node_cost[cut], mat)
            acc_recon = _series_recon(acc_recon, rec, arg, cut)
            acc = new
        return acc, acc_recon


def _series_recon(left: Recon, right: Recon, arg: np.ndarray, cut: int) -> Recon:
    def recon(i: int, j: int) -> Assign:
        x = int(arg[i, j])
        out = left(i, x)
        out.update(right(x, j))
        out[cut] = x
        return out

    return recon
