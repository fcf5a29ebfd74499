"""The one topological sort (Kahn's algorithm), for every graph in the package."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any


def topological_order(preds: Sequence[Iterable[int]], key: Callable[[int], Any] | None = None) -> list[int]:
    """Vertices 0..n-1 (vertex i waits for the vertices in `preds[i]`) in an order where every vertex
    comes after its predecessors.

    Among the vertices ready at once, the smallest `key(i)` goes first; without `key`, first ready,
    first out (the initially ready ones by index). ValueError if the graph has a cycle."""
    n = len(preds)
    missing = [0] * n
    succ: list[list[int]] = [[] for _ in range(n)]
    for i, ps in enumerate(preds):
        for p in ps:
            succ[p].append(i)
            missing[i] += 1
    seq = itertools.count()

    def prio(i: int):
        return (key(i), i) if key is not None else (next(seq), i)

    heap = [prio(i) for i in range(n) if missing[i] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        i = heapq.heappop(heap)[-1]
        order.append(i)
        for s in succ[i]:
            missing[s] -= 1
            if missing[s] == 0:
                heapq.heappush(heap, prio(s))
    if len(order) != n:
        raise ValueError(f"graph has a cycle through {n - len(order)} vertices")
    return order
