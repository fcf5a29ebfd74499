"""Coarsening for the search: merge nodes so that placers and DP/ILP searches stay small.

Every merge contracts a *convex* set of nodes (no path leaves the set and comes back), so the coarse
graph stays acyclic. A coarse node carries summed FLOPs and parameters, the out_shape of its last member,
the op/module/attrs of its heaviest member (by forward FLOPs: the conv of a fused conv-BN-ReLU), and attrs
`members` (fine node names), `modules` (module names), `ops` (fine op kinds) and `scope` (the longest
module prefix common to its members). Graph input nodes are never merged.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable

from hybridpar.graph.types import Graph, Node

ANCHORS = frozenset({"conv2d", "linear"})
FUSABLE = frozenset({"batchnorm", "layernorm", "relu", "pointwise", "dropout"})


def fuse_pointwise(graph: Graph) -> Graph:
    """Fold each BN/ReLU/pointwise/dropout that is the sole consumer of a conv/linear (or of such a
    fused chain) into it."""
    group_of: dict[str, str] = {}
    groups: dict[str, list[str]] = {}
    succ = graph.successors
    for n in graph.nodes:
        head = None
        if n.op in FUSABLE and len(n.inputs) == 1 and len(succ[n.inputs[0]]) == 1:
            cand = group_of[n.inputs[0]]
            if graph.node(cand).op in ANCHORS:
                head = cand
        head = head or n.name
        group_of[n.name] = head
        groups.setdefault(head, []).append(n.name)
    return merge_groups(graph, list(groups.values()))


def collapse_chains(graph: Graph) -> Graph:
    """Merge every linear chain u -> v where u feeds only v and v reads only u."""
    group_of: dict[str, str] = {}
    groups: dict[str, list[str]] = {}
    succ = graph.successors
    for n in graph.nodes:
        head = n.name
        if n.op != "input" and len(n.inputs) == 1:
            u = n.inputs[0]
            if graph.node(u).op != "input" and len(succ[u]) == 1:
                head = group_of[u]
        group_of[n.name] = head
        groups.setdefault(head, []).append(n.name)
    return merge_groups(graph, list(groups.values()))


def coarsen_to(graph: Graph, max_nodes: int) -> Graph:
    """At most `max_nodes` nodes, as many as allowed: a graph that fits is returned as is; otherwise
    pointwise ops are fused, then pairs are merged one at a time: links of single-in/single-out chains
    first, then adjacent nodes sharing the deepest module prefix (ties: the smallest combined forward
    FLOPs), so branches, then residual/Inception blocks, then stages become single nodes. Input nodes stay apart, so
    at least inputs + 1 nodes remain."""
    if max_nodes < 1:
        raise ValueError("max_nodes must be >= 1")
    if len(graph) <= max_nodes:
        return graph
    g = fuse_pointwise(graph)
    if len(g) <= max_nodes:
        return g
    return merge_groups(g, _greedy_partition(g, max_nodes))


# --- greedy contraction ---------------------------------------------------------------------------

def _scope(node: Node) -> tuple[str, ...]:
    s = node.attr("scope")
    return tuple(s.split(".")) if s else ()


def _common(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return a[:k]


def _greedy_partition(g: Graph, max_nodes: int) -> list[list[str]]:
    order = {n.name: i for i, n in enumerate(g.nodes)}
    members = {n.name: [n.name] for n in g.nodes}
    succ = {n.name: set(g.successors[n.name]) for n in g.nodes}
    pred = {n.name: set(n.inputs) for n in g.nodes}
    flops = {n.name: n.fwd_flops for n in g.nodes}
    scope = {n.name: _scope(n) for n in g.nodes}
    fixed = {n.name for n in g.nodes if n.op == "input"}
    while len(members) > max_nodes:
        topo = _topo(members, pred, order)
        pairs = {(a, b) for a in members for b in succ[a]}
        pairs |= set(itertools.pairwise(topo))
        def key(p, succ=succ, pred=pred):
            a, b = p
            chain = b in succ[a] and len(succ[a]) == 1 and len(pred[b]) == 1
            return (not chain, -len(_common(scope[a], scope[b])), flops[a] + flops[b], order[a], order[b])

        cands = sorted((p for p in pairs if not (set(p) & fixed)), key=key)
        pair = next((p for p in cands if _contractible(*p, succ)), None)
        if pair is None:
            break
        a, b = pair
        members[a] += members.pop(b)
        flops[a] += flops.pop(b)
        scope[a] = _common(scope[a], scope.pop(b))
        order[a] = min(order[a], order.pop(b))
        for x in pred.pop(b):
            succ[x].discard(b)
            if x != a:
                succ[x].add(a)
                pred[a].add(x)
        for y in succ.pop(b):
            pred[y].discard(b)
            if y != a:
                pred[y].add(a)
                succ[a].add(y)
        pred[a].discard(a)
        succ[a].discard(a)
    return list(members.values())


def _contractible(a: str, b: str, succ: dict[str, set[str]]) -> bool:
    """Merging a and b keeps the graph acyclic iff neither reaches the other through a third node."""
    return not (_reaches_via(a, b, succ) or _reaches_via(b, a, succ))


def _reaches_via(src: str, dst: str, succ: dict[str, set[str]]) -> bool:
    stack = [x for x in succ[src] if x != dst]
    seen = set(stack)
    while stack:
        x = stack.pop()
        for y in succ[x]:
            if y == dst:
                return True
            if y not in seen:
                seen.add(y)
                stack.append(y)
    return False


def _topo(members: dict[str, list[str]], pred: dict[str, set[str]], order: dict[str, int]) -> list[str]:
    """Kahn's algorithm, ties broken by original position (stable)."""
    indeg = {k: len(pred[k]) for k in members}
    succ: dict[str, list[str]] = {k: [] for k in members}
    for k in members:
        for p in pred[k]:
            succ[p].append(k)
    heap = [(order[k], k) for k, d in indeg.items() if d == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        _, k = heapq.heappop(heap)
        out.append(k)
        for s in succ[k]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, (order[s], s))
    if len(out) != len(members):
        raise AssertionError("coarsening produced a cycle")
    return out


# --- building the coarse graph --------------------------------------------------------------------

def merge_groups(graph: Graph, groups: Iterable[Iterable[str]]) -> Graph:
    """The graph with each group (a convex set of node names; together a partition) as one node."""
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    parts = [sorted(g, key=index.__getitem__) for g in groups]
    head_of = {name: part[0] for part in parts for name in part}
    if len(head_of) != len(graph.nodes):
        raise ValueError("groups must partition the graph's nodes")
    merged = {part[0]: _merge_nodes([graph.node(x) for x in part], head_of) for part in parts}
    pred = {h: set(n.inputs) for h, n in merged.items()}
    order = {h: index[h] for h in merged}
    topo = _topo({h: [h] for h in merged}, pred, order)
    return Graph(graph.name, tuple(merged[h] for h in topo), batch=graph.batch, meta=graph.meta)


def _members(n: Node) -> tuple[str, ...]:
    return tuple(n.attr("members") or (n.name,))


def _modules(n: Node) -> tuple[str, ...]:
    mods = n.attr("modules")
    if mods is not None:
        return tuple(mods)
    return (n.module,) if n.module else ()


def _merge_nodes(nodes: list[Node], head_of: dict[str, str]) -> Node:
    head = nodes[0].name
    inside = {n.name for n in nodes}
    ext: dict[str, tuple[int, ...]] = {}
    for n in nodes:
        for i, s in zip(n.inputs, n.in_shapes or ((),) * len(n.inputs)):
            if i not in inside:
                ext.setdefault(i, s)
    inputs = tuple(dict.fromkeys(head_of[i] for i in ext))
    heavy = max(nodes, key=lambda n: n.fwd_flops)  # first of the heaviest on ties
    scope: tuple[str, ...] | None = None
    for n in nodes:
        s = _scope(n)
        scope = s if scope is None else _common(scope, s)
    attrs = {k: v for k, v in heavy.attrs if k not in ("members", "modules", "ops", "scope")}
    attrs.update(members=tuple(m for n in nodes for m in _members(n)),
                 modules=tuple(dict.fromkeys(m for n in nodes for m in _modules(n))),
                 ops=tuple(o for n in nodes for o in (n.attr("ops") or (n.op,))),
                 scope=".".join(scope or ()) or None)
    return Node(
        name=head, op=heavy.op, inputs=inputs, in_shapes=tuple(ext.values()), out_shape=nodes[-1].out_shape,
        module=heavy.module, param_shapes=tuple(p for n in nodes for p in n.param_shapes),
        fwd_flops=sum(n.fwd_flops for n in nodes), bwd_data_flops=sum(n.bwd_data_flops for n in nodes),
        bwd_weight_flops=sum(n.bwd_weight_flops for n in nodes), attrs=tuple(attrs.items()))
