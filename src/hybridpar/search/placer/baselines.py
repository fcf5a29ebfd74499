"""Baseline placers in the same problem and cost model as the ILP.

single: everything on device 0.  dp: contiguous partition of the topological order minimising the
slowest stage (PipeDream's partitioner, Narayanan et al. SOSP'19).  etf: m-ETF (Baechi, Jeon et al.
SoCC'20): earliest-task-first list placement under memory limits.  greedy: HEFT-style list scheduler
(Topcuoglu et al. 2002): tasks by upward rank, each to the device that finishes it first.
All return a PlacementResult timed by the same list scheduler (schedule.list_schedule).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from hybridpar.errors import InfeasibleError
from hybridpar.search.placer.problem import PlacementProblem, fmt_bytes
from hybridpar.search.placer.result import PlacementResult, evaluate, fits


def place_single(problem: PlacementProblem) -> PlacementResult:
    t0 = time.perf_counter()
    assignment = [0] * len(problem.tasks)
    if not fits(problem, assignment):
        need = sum(t.mem_bytes for t in problem.tasks)
        raise InfeasibleError(f"{problem.name} needs {fmt_bytes(need)} on one device, which holds "
                              f"{fmt_bytes(problem.mem_capacity_bytes[0])}")
    return evaluate(problem, assignment, "single", solve_time_s=time.perf_counter() - t0)


def _cuttable(problem: PlacementProblem) -> list[bool]:
    """cuttable[c]: a stage boundary may sit before task c (it may not split a tie group, the time
    chunks of one module)."""
    n = len(problem.tasks)
    root = problem.tie_root
    last_of: dict[int, int] = {}
    for u in range(n):
        last_of[root[u]] = u
    cuttable = [True] * (n + 1)
    for u in range(n):
        for c in range(root[u] + 1, last_of[root[u]] + 1):
            cuttable[c] = False
    return cuttable


def place_dp(problem: PlacementProblem) -> PlacementResult:
    """Contiguous stages s = 0..k-1 on devices 0..k-1 (k <= M), minimising the max stage time
    (compute + sending its outputs to the next stage and their gradients back). Tie groups must be
    contiguous in the task order (they are never split)."""
    t0 = time.perf_counter()
    n, m = len(problem.tasks), problem.num_devices
    tasks = problem.tasks
    last_use = [max(problem.succs[u], default=u) for u in range(n)]

    def stage_cost(i: int, j: int, s: int) -> float:
        mem = sum(t.mem_bytes for t in tasks[i:j])
        if mem > problem.mem_capacity_bytes[s]:
            return math.inf
        comp = sum(t.fwd_s[s] + t.bwd_s[s] for t in tasks[i:j])
        if j < n and s + 1 < m:
            out = sum(tasks[u].out_bytes for u in range(i, j) if last_use[u] >= j)
            comp += 2 * problem.transfer_s(out, s, s + 1)
        return comp

    inf = math.inf
    cuttable = _cuttable(problem)
    best = [[inf] * (n + 1) for _ in range(m + 1)]
    cut = [[0] * (n + 1) for _ in range(m + 1)]
    best[0][0] = 0.0
    for k in range(1, m + 1):
        for j in range(1, n + 1):
            if not cuttable[j]:
                continue
            for i in range(k - 1, j):
                if best[k - 1][i] == inf or not cuttable[i]:
                    continue
                c = max(best[k - 1][i], stage_cost(i, j, k - 1))
                if c < best[k][j]:
                    best[k][j], cut[k][j] = c, i
    k = min(range(1, m + 1), key=lambda k: (best[k][n], k))
    if best[k][n] == inf:
        raise InfeasibleError(f"{problem.name}: no contiguous partition over {m} device(s) fits in memory")
    assignment = [0] * n
    j = n
    while k > 0:
        i = cut[k][j]
        for u in range(i, j):
            assignment[u] = k - 1
        j, k = i, k - 1
    return evaluate(problem, assignment, "dp", solve_time_s=time.perf_counter() - t0)


class _Placer:
    """Incremental state shared by the list placers: device free times, memory, finish times."""

    def __init__(self, problem: PlacementProblem) -> None:
        self.p = problem
        n, m = len(problem.tasks), problem.num_devices
        self.dev: list[int | None] = [None] * n
        self.finish = [0.0] * n
        self.free = [0.0] * m
        self.mem = [0] * m
        self.buffers: set[tuple[int, int]] = set()
        # tied tasks: the first one placed picks the device and reserves the whole group's memory
        self.root = problem.tie_root
        self.group_mem: dict[int, int] = {}
        self.group_dev: dict[int, int] = {}
        for v, r in enumerate(self.root):
            self.group_mem[r] = self.group_mem.get(r, 0) + problem.tasks[v].mem_bytes

    def allowed(self, v: int) -> range | tuple[int]:
        d = self.group_dev.get(self.root[v])
        return range(self.p.num_devices) if d is None else (d,)

    def extra_mem(self, v: int, d: int) -> int:
        extra = 0 if self.root[v] in self.group_dev else self.group_mem[self.root[v]]
        for u in self.p.preds[v]:
            if self.dev[u] != d and (u, d) not in self.buffers:
                extra += self.p.tasks[u].out_bytes
        return extra

    def fits(self, v: int, d: int) -> bool:
        return self.mem[d] + self.extra_mem(v, d) <= self.p.mem_capacity_bytes[d]

    def est(self, v: int, d: int) -> float:
        ready = 0.0
        for u in self.p.preds[v]:
            a = self.dev[u]
            ready = max(ready, self.finish[u] + self.p.transfer_s(self.p.tasks[u].out_bytes, a, d))
        return max(ready, self.free[d])

    def put(self, v: int, d: int, cost: Callable[[int, int], float]) -> None:
        s = self.est(v, d)
        self.mem[d] += self.extra_mem(v, d)
        for u in self.p.preds[v]:
            if self.dev[u] != d:
                self.buffers.add((u, d))
        self.dev[v] = d
        self.group_dev[self.root[v]] = d
        self.finish[v] = s + cost(v, d)
        self.free[d] = self.finish[v]

    def no_fit(self, v: int) -> InfeasibleError:
        t = self.p.tasks[v]
        cap = fmt_bytes(self.p.mem_capacity_bytes[0])
        return InfeasibleError(f"{self.p.name}: node {t.name!r} ({fmt_bytes(t.mem_bytes)}) fits on no device "
                               f"once earlier nodes are placed (device memory {cap})")


def place_etf(problem: PlacementProblem) -> PlacementResult:
    """m-ETF on the forward graph: among ready (node, device) pairs with room, place the one that can
    start earliest (ties: the longer remaining path first, then the lower device)."""
    t0 = time.perf_counter()
    st = _Placer(problem)
    rank = _upward_rank(problem)
    missing = [len(ps) for ps in problem.preds]
    ready = {v for v in range(len(problem.tasks)) if missing[v] == 0}

    def fwd(v: int, d: int) -> float:
        return problem.tasks[v].fwd_s[d]

    while ready:
        cands = [(st.est(v, d), -rank[v], d, v) for v in ready for d in st.allowed(v) if st.fits(v, d)]
        if not cands:
            raise st.no_fit(max(ready, key=lambda v: problem.tasks[v].mem_bytes))
        _, _, d, v = min(cands)
        st.put(v, d, fwd)
        ready.discard(v)
        for s in problem.succs[v]:
            missing[s] -= 1
            if missing[s] == 0:
                ready.add(s)
    return evaluate(problem, st.dev, "etf", solve_time_s=time.perf_counter() - t0)


def place_greedy(problem: PlacementProblem) -> PlacementResult:
    """HEFT: tasks by decreasing upward rank (forward+backward time and transfers), each to the device
    with the earliest finish that has room."""
    t0 = time.perf_counter()
    st = _Placer(problem)
    rank = _upward_rank(problem)

    def step(v: int, d: int) -> float:
        return problem.tasks[v].fwd_s[d] + problem.tasks[v].bwd_s[d]

    # decreasing upward rank is a topological order (a predecessor's rank exceeds its successor's)
    for v in sorted(range(len(problem.tasks)), key=lambda v: (-rank[v], v)):
        cands = [(st.est(v, d) + step(v, d), d) for d in st.allowed(v) if st.fits(v, d)]
        if not cands:
            raise st.no_fit(v)
        st.put(v, min(cands)[1], step)
    return evaluate(problem, st.dev, "greedy", solve_time_s=time.perf_counter() - t0)


def _upward_rank(problem: PlacementProblem) -> list[float]:
    """Mean step time of the task plus the longest mean path (with mean transfer) to a sink."""
    m = problem.num_devices
    pairs = [(a, b) for a in range(m) for b in range(m) if a != b]
    rank = [0.0] * len(problem.tasks)
    for u in reversed(range(len(problem.tasks))):
        t = problem.tasks[u]
        own = (sum(t.fwd_s) + sum(t.bwd_s)) / m
        comm = (sum(problem.transfer_s(t.out_bytes, a, b) for a, b in pairs) / len(pairs)) if pairs else 0.0
        # strictly positive increments keep decreasing rank topological even for zero-cost tasks
        rank[u] = own + 1e-12 + max((rank[v] + comm for v in problem.succs[u]), default=0.0)
    return rank


BASELINES: dict[str, Callable[[PlacementProblem], PlacementResult]] = {
    "single": place_single, "dp": place_dp, "etf": place_etf, "greedy": place_greedy,
}


def best_baseline(problem: PlacementProblem) -> tuple[PlacementResult | None, list[PlacementResult]]:
    """Run every baseline that finds a placement fitting in memory; return the fastest and all."""
    results = []
    for fn in BASELINES.values():
        try:
            r = fn(problem)
        except InfeasibleError:
            continue
        if fits(problem, r.assignment):
            results.append(r)
    return (min(results, key=lambda r: r.step_time_s) if results else None), results
