"""Collective times on a real topology: alpha-beta-gamma with each transfer's bottleneck link.

Notation: p ranks, n bytes (one rank's buffer: for allgather the gathered result, for reduce-scatter
the input), alpha = per-message latency of a hop, beta = 1/bandwidth of a hop, gamma = seconds per
byte reduced. On a homogeneous network the functions reduce to the textbook closed forms
(Thakur, Rabenseifner & Gropp, IJHPCA 2005; Chan et al. 2007):

    p2p                 alpha + n beta
    ring allreduce      2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma
    ring reduce-scatter (p-1) alpha + (p-1)/p n beta + (p-1)/p n gamma
    ring allgather      (p-1) alpha + (p-1)/p n beta
    tree allreduce      2 ceil(log2 p) (alpha + n beta) + ceil(log2 p) n gamma   (binomial reduce + bcast)
    tree broadcast      ceil(log2 p) (alpha + n beta)
    scatter-allgather   (ceil(log2 p) + p-1) alpha + 2(p-1)/p n beta             (broadcast, p = 2^k)
    pairwise alltoall   (p-1) (alpha + n/p beta)
    hierarchical        intra-node reduce-scatter + inter-node allreduce of n/L (L ranks per node,
                        L concurrent rings) + intra-node allgather

plus `cluster.collective_base_latency_s` once per call (library start-up, NCCL's base latency).

On a real topology each ring step's time is its slowest transfer: max hop latency + chunk / the
bandwidth the transfer gets, where a link's capacity is shared evenly by all transfers that use it at
the same time (other groups' rings too: that is the segmented allreduce's contention). Rings run in
both directions with half the data each, as NCCL does, so full-duplex links (NVLink, the two
directions of a mesh pair) carry both halves at once while a shared port (an NVSwitch port, a NIC)
gains nothing. The ring order is chosen as a library would: grouped by node and, inside a mesh node,
the Hamiltonian cycle with the widest bottleneck (on DGX-1 the cycle over the double NVLinks).
Inside a mesh node a ring collective runs as several rings at once over the direct links the first
leaves spare (as NCCL does; on DGX-1 the double-link cycle plus the single-link cycle), data split in
proportion to their bottlenecks. Not modelled: NVLink SHARP, protocol switching, overlap with
computation.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar, cast

import numpy as np

from hybridpar.cluster.model import Cluster

if TYPE_CHECKING:
    from hybridpar.plans import LayerLayout

Algo = Literal["auto", "ring", "tree", "hierarchical"]


@dataclass(frozen=True)
class CommOp:
    """One collective a rank issues per training step: the one description the analytic twin of the
    runtime (`cost.layout_comm`), the planner and the profiler share.

    `bytes_` is one rank's full buffer (for allgather the gathered result, for reduce-scatter the
    input). `group` names which ranks take part ("filter" | "channel" | "sample" | "shard" |
    "replica" | "world"), `group_size` how many. Placed on a cluster, `groups` holds the concrete
    concurrent rank groups (not part of equality) and `layout` the layer layout that, with `group`,
    names them (a cheap cache key)."""

    kind: str  # "allreduce" | "allgather" | "reduce_scatter" | "alltoall"
    group_size: int
    bytes_: int
    group: str
    phase: str = "fwd"  # "fwd" | "bwd" | "grad" (weight-gradient sync, may overlap backward) | "loss"
    groups: tuple[tuple[int, ...], ...] = field(default=(), compare=False, hash=False, repr=False)
    layout: LayerLayout | None = None

    @classmethod
    def placed(cls, kind: str, phase: str, bytes_: int, groups: tuple[tuple[int, ...], ...], group: str,
               layout: LayerLayout) -> CommOp:
        """A collective on concrete rank groups (the planner's view)."""
        return cls(kind, len(groups[0]), bytes_, group, phase, groups, layout)

_Flow = tuple[int, int, float]  # (src, dst, bytes per unit of n)


@dataclass(frozen=True)
class _Affine:
    """time(n) = a + b n for one ring/tree/phase."""

    a: float
    b: float

    def at(self, n: float) -> float:
        return self.a + self.b * n


_CACHE: dict[tuple, object] = {}
_T = TypeVar("_T")


def _cached(key: tuple, make: Callable[[], _T]) -> _T:
    """`make()`, kept under `key` (a None result is not kept: asked again, it is made again)."""
    hit = _CACHE.get(key)
    if hit is None:
        if len(_CACHE) > 200_000:
            _CACHE.clear()
        hit = _CACHE[key] = make()
    return cast(_T, hit)  # what `make` returned for this key


# -- the link-sharing core -------------------------------------------------------------------------

def _step(flows: Sequence[_Flow], cluster: Cluster, load: Counter | None = None) -> _Affine:
    """One step in which `flows` run at once: max latency + max (bytes / bandwidth it gets).
    `load` counts every transfer on each link in this step, including other groups' transfers."""
    if not flows:
        return _Affine(0.0, 0.0)
    if load is None and len(flows) >= 16 and (table := _route_table(cluster)) is not None:
        return _step_vectorised(flows, cluster, table)
    routes = [cluster.route(s, d) for s, d, _ in flows]
    if load is None:
        load = Counter(link for r in routes for link in r.links)
    alpha = max(r.latency_s for r in routes)
    beta = 0.0
    for (_, _, coef), r in zip(flows, routes):
        if r.links:
            bw = min(cap / load[link] for link, cap in zip(r.links, r.capacities_Bps))
            beta = max(beta, coef / bw)
    return _Affine(alpha, beta)


def _step_vectorised(flows: Sequence[_Flow], cluster: Cluster, table: _RouteTable) -> _Affine:
    """`_step` on arrays (the same floats), for steps with many flows (a tree level over many nodes)."""
    src = np.fromiter((f[0] for f in flows), dtype=np.int64, count=len(flows))
    dst = np.fromiter((f[1] for f in flows), dtype=np.int64, count=len(flows))
    coef = np.fromiter((f[2] for f in flows), dtype=float, count=len(flows))
    (alpha,), (beta,) = _bottlenecks(cluster, table, src, dst, coef, np.zeros(1, dtype=np.int64))
    return _Affine(alpha, max(0.0, beta))


def _bottlenecks(cluster: Cluster, table: _RouteTable, src: np.ndarray, dst: np.ndarray, coef: np.ndarray,
                 starts: np.ndarray) -> tuple[list[float], list[float]]:
    """Per group of flows (contiguous, from each start): the largest latency and the largest
    coef / bandwidth, every link shared evenly by all the flows on it."""
    g = cluster.gpus_per_node
    if src.min() < 0 or max(src.max(), dst.max()) >= cluster.num_devices:
        cluster.route(int(src.min()), int(dst.max()))  # raises the cluster's own error
    cls = _route_class(src, dst, g)
    side, cap = table.side[cls], table.cap[cls]
    node = np.where(side == 0, (src // g)[:, None], (dst // g)[:, None])
    link = node * table.per_node + table.local[cls]
    valid = side >= 0
    load = np.bincount(link[valid], minlength=1)
    per_link = np.where(valid, cap / np.where(valid, load[np.where(valid, link, 0)], 1), np.inf)
    bw = per_link.min(axis=1)
    beta = np.maximum.reduceat(coef / bw, starts)
    alpha = np.maximum.reduceat(table.latency[cls], starts)
    return alpha.tolist(), beta.tolist()


def _ring_flows(ring: Sequence[int], coef: float) -> list[_Flow]:
    """One ring step in both directions, each carrying half of `coef`."""
    p = len(ring)
    fwd = [(ring[i], ring[(i + 1) % p], coef / 2) for i in range(p)]
    rev = [(ring[(i + 1) % p], ring[i], coef / 2) for i in range(p)]
    return fwd + rev


# -- ring order ------------------------------------------------------------------------------------

def ring_order(ranks: Iterable[int], cluster: Cluster) -> tuple[int, ...]:
    """The order a collective library would run a ring in: node by node, and inside a mesh node the
    cycle whose bottleneck link is widest."""
    members = tuple(ranks)
    if not members:
        return members
    for r in (min(members), max(members)):
        cluster.node_of(r)  # raises for a device outside the cluster
    g = cluster.gpus_per_node
    if cluster.intra.kind != "mesh" or g <= 3:  # node by node, each node's devices in order: sorted
        return tuple(sorted(members))
    if len(members) >= 32:  # many nodes alike (the same local devices in each): reorder them at once
        rows = _alike_nodes(members, g)
        if rows is not None:
            first = tuple(rows[0].tolist())
            best = _best_node_order(first, cluster)
            perm = [first.index(d) for d in best]
            return tuple(rows[:, perm].ravel().tolist())
    by_node: dict[int, list[int]] = {}
    for r in members:
        by_node.setdefault(r // g, []).append(r)
    out: list[int] = []
    for node in sorted(by_node):
        out.extend(_best_node_order(tuple(sorted(by_node[node])), cluster))
    return tuple(out)


def _alike_nodes(members: tuple[int, ...], g: int) -> np.ndarray | None:
    """The sorted members as one row per node when every node holds the same local devices of the
    group (and no rank twice), else None."""
    arr = np.sort(np.asarray(members, dtype=np.int64))
    node = arr // g
    k = int(np.count_nonzero(node == node[0]))
    if len(arr) % k or (len(arr) > 1 and (np.diff(arr) == 0).any()):
        return None
    rows = arr.reshape(-1, k)
    row_node = rows // g
    if not ((row_node == row_node[:, :1]).all() and (np.diff(row_node[:, 0]) > 0).all()
            and (rows % g == rows[:1] % g).all()):
        return None
    return rows


def _best_node_order(devs: tuple[int, ...], cluster: Cluster) -> tuple[int, ...]:
    if cluster.intra.kind != "mesh" or len(devs) <= 3:
        return devs
    # Every node is wired alike: search once per set of local indices, then shift to this node.
    offset = devs[0] - cluster.local_of(devs[0])
    local = tuple(d - offset for d in devs)
    key = ("order", cluster.cache_key, local)
    best = _cached(key, lambda: _search_order(local, cluster))
    return tuple(d + offset for d in best)


def _search_order(devs: tuple[int, ...], cluster: Cluster) -> tuple[int, ...]:
    hop = {(a, b): cluster.route(a, b) for a in devs for b in devs if a != b}

    def score(order: tuple[int, ...]) -> tuple[float, float]:
        # Same as _step(_ring_flows(order, 1.0)) but fast enough to enumerate 7! cycles.
        pairs = [(order[i], order[(i + 1) % len(order)]) for i in range(len(order))]
        pairs += [(b, a) for a, b in pairs]
        load = Counter(link for pr in pairs for link in hop[pr].links)
        worst_bw = min(cap / load[link] for pr in pairs
                       for link, cap in zip(hop[pr].links, hop[pr].capacities_Bps))
        return (1.0 / worst_bw, max(hop[pr].latency_s for pr in pairs))

    first, rest = devs[0], devs[1:]
    if len(devs) <= 9:
        candidates = ((first, *perm) for perm in itertools.permutations(rest))
        return min(candidates, key=score)
    # Too many members to enumerate: greedy, always to the neighbour with most direct links.
    order, left = [first], set(rest)
    while left:
        nxt = max(sorted(left), key=lambda d: cluster.nvlinks(order[-1], d))
        order.append(nxt)
        left.remove(nxt)
    return tuple(order)


def _cycle_set(devs: tuple[int, ...], cluster: Cluster) -> list[tuple[tuple[int, ...], float]]:
    """Rings a library runs at once inside one mesh node, each with its share of the data: the widest
    cycle, then the widest cycle over the direct links it leaves spare, and so on (NCCL builds several
    rings over the NVLinks; on DGX-1 the double-link cycle carries 2/3 and the single-link cycle 1/3).
    Shares are proportional to each cycle's bottleneck, so every ring finishes at the same time."""
    if cluster.intra.kind != "mesh" or len(devs) < 3:
        return [(devs, 1.0)]
    offset = devs[0] - cluster.local_of(devs[0])
    local = tuple(d - offset for d in devs)
    key = ("cycles", cluster.intra.model_dump_json(), cluster.gpus_per_node, local)
    cycles = _cached(key, lambda: _search_cycles(local, cluster))
    return [(tuple(d + offset for d in order), share) for order, share in cycles]


def _search_cycles(devs: tuple[int, ...], cluster: Cluster) -> list[tuple[tuple[int, ...], float]]:
    first = _best_node_order(devs, cluster)
    spare = {(a, b): cluster.nvlinks(a, b) for a in devs for b in devs if a != b}

    def bottleneck(order: tuple[int, ...]) -> int:
        return min(spare[(order[i], order[(i + 1) % len(order)])] for i in range(len(order)))

    found: list[tuple[tuple[int, ...], int]] = []
    order: tuple[int, ...] | None = first
    while order is not None and len(found) < 4:
        width = bottleneck(order)
        if width <= 0:
            break  # the cycle needs the host path: it stays the only ring
        found.append((order, width))
        for i in range(len(order)):
            a, b = order[i], order[(i + 1) % len(order)]
            spare[(a, b)] -= width
            spare[(b, a)] -= width
        rest = devs[1:]
        order = max(((devs[0], *perm) for perm in itertools.permutations(rest)), key=bottleneck) \
            if len(devs) <= 9 else None
    if not found:
        return [(first, 1.0)]
    total = sum(w for _, w in found)
    return [(o, w / total) for o, w in found]


# -- phases: concurrent rings ----------------------------------------------------------------------

_STEPS = {"allreduce": lambda p: 2 * (p - 1), "reduce_scatter": lambda p: p - 1, "allgather": lambda p: p - 1}


def _rings_phase(rings: Sequence[tuple[int, ...]], kind: str, frac: float, cluster: Cluster) -> list[_Affine]:
    """Per-ring time of `kind` on each ring, all rings running at once over n*frac bytes each."""
    rings = [r for r in rings if len(r) > 1]
    table = _route_table(cluster)
    if table is not None and rings:
        return _rings_phase_vectorised(rings, kind, frac, cluster, table)
    return _rings_phase_scalar(rings, kind, frac, cluster)


@dataclass(frozen=True)
class _RouteTable:
    """Every route of a cluster by (same node?, local index of source, of destination): which
    endpoint's node each link belongs to (0 source, 1 destination, -1 none), the link's id within a
    node, its capacity, and the route's latency. A route's links are node-local ids ("n{node}:...")
    that depend on the endpoints' local indices only, so one table serves every node."""

    per_node: int  # distinct node-local link ids
    side: np.ndarray  # [class, k] int
    local: np.ndarray  # [class, k] int
    cap: np.ndarray  # [class, k] float (inf where no link)
    latency: np.ndarray  # [class] float


def _route_table(cluster: Cluster) -> _RouteTable | None:
    return _cached(("routes", cluster.cache_key), lambda: _build_route_table(cluster)) or None


def _build_route_table(cluster: Cluster) -> _RouteTable | Literal[False]:
    """False when the cluster's routes do not follow the node-local pattern (then the scalar path)."""
    g, nodes = cluster.gpus_per_node, cluster.num_nodes
    if g < 1 or cluster.num_devices < 2:
        return False
    ids: dict[str, int] = {}
    rows: dict[int, tuple[list[int], list[int], list[float], float]] = {}
    for same in (0, 1):
        if same == 0 and (nodes < 2 or cluster.num_devices < g + 1):
            continue
        for la in range(g):
            for lb in range(g):
                a, b = la, (lb if same else g + lb)
                if a == b or max(a, b) >= cluster.num_devices:
                    continue
                r = cluster.route(a, b)
                sides, locs = [], []
                for link in r.links:
                    head, sep, rest = link.partition(":")
                    if not (sep and head[:1] == "n" and head[1:].isdigit()):
                        return False
                    node = int(head[1:])
                    if node not in (a // g, b // g):
                        return False
                    sides.append(0 if node == a // g else 1)
                    locs.append(ids.setdefault(rest, len(ids)))
                rows[same * g * g + la * g + lb] = (sides, locs, list(r.capacities_Bps), r.latency_s)
    width = max((len(v[0]) for v in rows.values()), default=0) or 1
    side = np.full((2 * g * g, width), -1, dtype=np.int64)
    local = np.zeros((2 * g * g, width), dtype=np.int64)
    cap = np.full((2 * g * g, width), np.inf)
    latency = np.zeros(2 * g * g)
    for c, (sides, locs, caps, lat) in rows.items():
        side[c, :len(sides)] = sides
        local[c, :len(locs)] = locs
        cap[c, :len(caps)] = caps
        latency[c] = lat
    table = _RouteTable(max(len(ids), 1), side, local, cap, latency)
    # the pattern holds for a sample of pairs in other nodes, or the table is not used
    probe = [(a, b) for a in range(0, cluster.num_devices, max(1, cluster.num_devices // 7))
             for b in range(cluster.num_devices - 1, -1, -max(1, cluster.num_devices // 5)) if a != b]
    names = {v: k for k, v in ids.items()}
    for a, b in probe:
        c = _route_class(np.array([a]), np.array([b]), g)[0]
        want = cluster.route(a, b)
        got = tuple(f"n{(a if s == 0 else b) // g}:{names[int(loc)]}" for s, loc in zip(side[c], local[c]) if s >= 0)
        if got != want.links or float(latency[c]) != want.latency_s:
            return False
    return table


def _route_class(src: np.ndarray, dst: np.ndarray, g: int) -> np.ndarray:
    return (src // g == dst // g) * (g * g) + (src % g) * g + dst % g


def _rings_phase_vectorised(rings: Sequence[tuple[int, ...]], kind: str, frac: float, cluster: Cluster,
                            table: _RouteTable) -> list[_Affine]:
    """`_rings_phase_scalar` on arrays: the same flows, link loads, bottlenecks and the same floats."""
    p = len(rings[0])
    if all(len(r) == p for r in rings):
        flows = _uniform_ring_flows(rings, frac, cluster)
        if flows is not None:
            return _rings_phase_arrays(rings, kind, frac, cluster, table, *flows)
    srcs, dsts, coefs, starts = [], [], [], []
    count = 0
    for r in rings:
        starts.append(count)
        for order, share in _node_cycles(r, cluster):
            arr = np.asarray(order, dtype=np.int64)
            nxt = np.roll(arr, -1)
            half = frac * share / len(r) / 2  # as _ring_flows: each direction carries half
            srcs += [arr, nxt]
            dsts += [nxt, arr]
            coefs.append(np.full(2 * len(arr), half))
            count += 2 * len(arr)
    src, dst, coef = np.concatenate(srcs), np.concatenate(dsts), np.concatenate(coefs)
    return _rings_phase_arrays(rings, kind, frac, cluster, table, src, dst, coef, np.asarray(starts))


def _uniform_ring_flows(rings: Sequence[tuple[int, ...]], frac: float,
                        cluster: Cluster) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """The flows of rings of one length, each a single cycle in its own order (what _node_cycles
    gives a ring that spans nodes, or a sorted ring inside a node that runs one cycle), as arrays in
    one go; None when some ring runs several cycles or is reordered (then ring by ring)."""
    g, p = cluster.gpus_per_node, len(rings[0])
    ring = np.asarray(rings, dtype=np.int64)
    nodes = ring // g
    one_node = (nodes == nodes[:, :1]).all(axis=1)
    if one_node.all() and (ring % g == ring[:1] % g).all():
        # rings inside one node each, alike in every node: the first ring's cycles, shifted node by node
        shift = (nodes[:, :1] - nodes[0, 0]) * g
        srcs, dsts, coefs = [], [], []
        for order, share in _node_cycles(tuple(rings[0]), cluster):
            cyc = np.asarray(order, dtype=np.int64)[None, :] + shift
            nxt = np.roll(cyc, -1, axis=1)
            srcs += [cyc, nxt]
            dsts += [nxt, cyc]
            coefs.append(np.full((len(rings), 2 * len(order)), frac * share / p / 2))  # as _ring_flows
        src = np.concatenate(srcs, axis=1).ravel()
        dst = np.concatenate(dsts, axis=1).ravel()
        coef = np.concatenate(coefs, axis=1).ravel()
        return src, dst, coef, np.arange(len(rings)) * (len(src) // len(rings))
    if one_node.any():
        single_cycle = cluster.intra.kind != "mesh" or p < 3
        if not single_cycle or not (np.diff(ring[one_node], axis=1) > 0).all():
            return None
    nxt = np.roll(ring, -1, axis=1)
    src = np.concatenate([ring, nxt], axis=1).ravel()
    dst = np.concatenate([nxt, ring], axis=1).ravel()
    coef = np.full(src.shape, frac * 1.0 / p / 2)  # as _ring_flows(ring, frac * share / len(r)), share 1
    return src, dst, coef, np.arange(len(rings)) * (2 * p)


def _rings_phase_arrays(rings: Sequence[tuple[int, ...]], kind: str, frac: float, cluster: Cluster,
                        table: _RouteTable, src: np.ndarray, dst: np.ndarray, coef: np.ndarray,
                        starts: np.ndarray) -> list[_Affine]:
    alpha, beta = _bottlenecks(cluster, table, src, dst, coef, starts)
    reduces = kind != "allgather"
    p = len(rings[0])
    if all(len(r) == p for r in rings):  # rings of one length: each distinct bottleneck priced once
        steps = _STEPS[kind](p)
        gamma = (p - 1) / p * frac * cluster.gamma_s_per_byte if reduces else 0.0
        out = [_Affine(steps * a, steps * max(0.0, b) + gamma) for a, b in dict.fromkeys(zip(alpha, beta))]
        return list(dict.fromkeys(out)) if len(out) > 1 else out
    out = []
    for ring, a, b in zip(rings, alpha, beta):
        p, steps = len(ring), _STEPS[kind](len(ring))
        gamma = (p - 1) / p * frac * cluster.gamma_s_per_byte if reduces else 0.0
        out.append(_Affine(steps * a, steps * max(0.0, b) + gamma))
    if len(rings) > 1:  # a phase's time is its slowest ring: equal rings need evaluating once
        out = list(dict.fromkeys(out))
    return out


def _rings_phase_scalar(rings: Sequence[tuple[int, ...]], kind: str, frac: float,
                        cluster: Cluster) -> list[_Affine]:
    per_ring = [[f for order, share in _node_cycles(r, cluster) for f in _ring_flows(order, frac * share / len(r))]
                for r in rings]
    load = Counter(link for flows in per_ring for s, d, _ in flows for link in cluster.route(s, d).links)
    reduces = kind != "allgather"
    out = []
    for ring, flows in zip(rings, per_ring):
        p, steps = len(ring), _STEPS[kind](len(ring))
        st = _step(flows, cluster, load)
        gamma = (p - 1) / p * frac * cluster.gamma_s_per_byte if reduces else 0.0
        out.append(_Affine(steps * st.a, steps * st.b + gamma))
    return out


def _node_cycles(ring: tuple[int, ...], cluster: Cluster) -> list[tuple[tuple[int, ...], float]]:
    """A ring inside one node may run as several rings (see _cycle_set); across nodes it is one ring."""
    node = cluster.node_of(ring[0])
    if all(cluster.node_of(r) == node for r in ring):
        return _cycle_set(tuple(sorted(ring)), cluster)
    return [(ring, 1.0)]


def _phase_time(parts: Sequence[_Affine], n: float) -> float:
    if len(parts) == 1:
        return parts[0].at(n)
    return max((x.at(n) for x in parts), default=0.0)


_CHECKED: dict[int, tuple[object, tuple[tuple[int, ...], ...]]] = {}


def _groups_key(groups: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    # the planner asks about the same group tuples thousands of times: check each object once
    hit = _CHECKED.get(id(groups))
    if hit is not None and hit[0] is groups:
        return hit[1]
    out = []
    for g in groups:
        t = tuple(g)
        if len(set(t)) != len(t):
            raise ValueError(f"a collective group lists a rank twice: {t}")
        out.append(t)
    key = tuple(out)
    if isinstance(groups, tuple):
        if len(_CHECKED) > 50_000:
            _CHECKED.clear()
        _CHECKED[id(groups)] = (groups, key)  # holds `groups`, so its id is not reused
    return key


def _check_disjoint(key: tuple[tuple[int, ...], ...]) -> None:
    hit = _CHECKED.get(id(key))
    if hit is not None and hit[0] is key and hit[1] == ():
        return
    seen: set[int] = set()
    for g in key:
        if seen & set(g):
            raise ValueError("concurrent allreduce groups must be disjoint")
        seen |= set(g)
    _CHECKED[id(key)] = (key, ())


def _ring_orders(groups: Sequence[Sequence[int]], cluster: Cluster) -> list[tuple[int, ...]]:
    """`ring_order` of every group. Groups that are translates of one another by whole nodes (the
    planner's filter, channel and shard groups) have translated ring orders: one is computed per
    translation class, the rest are shifted copies."""
    if len(groups) < 8 or len({len(g) for g in groups}) != 1:
        return [ring_order(g, cluster) for g in groups]
    arr = np.asarray(groups, dtype=np.int64)
    off = arr[:, :1] - arr[:1, :1]
    if arr.min() < 0 or arr.max() >= cluster.num_devices or not (arr == arr[:1] + off).all():
        return [ring_order(g, cluster) for g in groups]
    g = cluster.gpus_per_node
    shift = off[:, 0]
    out: list[tuple[int, ...]] = [()] * len(groups)
    # sorted(set()) rather than np.unique: the same classes, without np.unique importing numpy.ma (40 ms)
    for r in sorted(set((shift % g).tolist())):  # one translation class at a time
        idx = np.flatnonzero(shift % g == r)
        first = int(idx[0])
        order = np.asarray(ring_order(groups[first], cluster), dtype=np.int64)
        shifted = (order[None, :] + (shift[idx] - shift[first])[:, None]).tolist()
        for i, row in zip(idx.tolist(), shifted):
            out[i] = tuple(row)
    return out


def _base(cluster: Cluster, groups: Sequence[Sequence[int]]) -> float:
    return cluster.collective_base_latency_s if any(len(g) > 1 for g in groups) else 0.0


# -- allreduce -------------------------------------------------------------------------------------

def _ring_allreduce(groups: Sequence[Sequence[int]], cluster: Cluster) -> list[list[_Affine]]:
    rings = _ring_orders(groups, cluster)
    return [_rings_phase(rings, "allreduce", 1.0, cluster)]


def _hier_allreduce(groups: Sequence[Sequence[int]], cluster: Cluster) -> list[list[_Affine]] | None:
    """Reduce-scatter inside each node, allreduce across nodes per local position, allgather inside."""
    intra_rings, inter_rings, frac = [], [], 1.0
    per_node = cluster.gpus_per_node
    for ordered in _ring_orders(groups, cluster):  # checked ranks: node_of is r // per_node
        by_node: dict[int, list[int]] = {}
        for r in ordered:
            by_node.setdefault(r // per_node, []).append(r)
        if len(by_node) < 2 or max(len(v) for v in by_node.values()) < 2:
            return None  # one node, or one rank per node: nothing hierarchical about it
        width = max(len(v) for v in by_node.values())
        frac = min(frac, 1.0 / width)
        intra_rings += [tuple(v) for v in by_node.values()]
        inter_rings += [tuple(v[j] for v in by_node.values() if j < len(v)) for j in range(width)]
    return [_rings_phase(intra_rings, "reduce_scatter", 1.0, cluster),
            _rings_phase(inter_rings, "allreduce", frac, cluster),
            _rings_phase(intra_rings, "allgather", 1.0, cluster)]


def _tree_levels(order: Sequence[int]) -> list[list[tuple[int, int]]]:
    """Binomial-tree reduce levels over `order` (index 0 is the root): (child, parent) pairs."""
    p, out, dist = len(order), [], 1
    while dist < p:
        out.append([(order[i], order[i - dist]) for i in range(dist, p, 2 * dist) if i % (2 * dist) == dist])
        dist *= 2
    return out


def _tree_allreduce(groups: Sequence[Sequence[int]], cluster: Cluster) -> list[list[_Affine]]:
    (g,) = groups
    order = ring_order(g, cluster)
    levels = _tree_levels(order)
    up = [_step([(c, par, 1.0) for c, par in lvl], cluster) for lvl in levels]
    down = [_step([(par, c, 1.0) for c, par in lvl], cluster) for lvl in reversed(levels)]
    gamma = len(levels) * cluster.gamma_s_per_byte
    return [[_Affine(sum(s.a for s in up + down), sum(s.b for s in up + down) + gamma)]]


_ALGOS: dict[str, Callable[[Sequence[Sequence[int]], Cluster], list[list[_Affine]] | None]] = {
    "ring": _ring_allreduce, "hierarchical": _hier_allreduce, "tree": _tree_allreduce}


def _allreduce_phases(groups: tuple[tuple[int, ...], ...], cluster: Cluster,
                      algo: str) -> list[list[_Affine]] | None:
    return _cached(("ar", cluster.cache_key, groups, algo), lambda: _ALGOS[algo](groups, cluster))


def _ring_phases(groups: tuple[tuple[int, ...], ...], cluster: Cluster) -> list[list[_Affine]]:
    """`_allreduce_phases(groups, cluster, "ring")`, which always applies."""
    return _cached(("ar", cluster.cache_key, groups, "ring"), lambda: _ring_allreduce(groups, cluster))


def _phases_time(phases: Sequence[Sequence[_Affine]], n: float) -> float:
    return sum(_phase_time(ph, n) for ph in phases)


def _measured(kind: str, bytes_: float, groups: Sequence[Sequence[int]], cluster: Cluster) -> float | None:
    """The cluster's measured time of `kind` in groups of this size (localhost), if it has one."""
    if not cluster.measured_collectives:
        return None
    sizes = {len(g) for g in groups}
    fit = cluster.measured_collective(kind, sizes.pop()) if len(sizes) == 1 else None
    return None if fit is None else fit.time_s(bytes_)


def allreduce_time(bytes_: float, ranks: Sequence[int], cluster: Cluster, algo: Algo = "auto") -> float:
    """Seconds for an allreduce of `bytes_` among `ranks` (algo ring/tree/hierarchical; auto = fastest)."""
    return concurrent_allreduce_time(bytes_, [ranks], cluster, algo=algo)


def allreduce_algo(bytes_: float, ranks: Sequence[int], cluster: Cluster) -> str:
    """The algorithm `auto` picks for this size and group."""
    groups = _groups_key([ranks])

    def seconds(algo: str) -> float:
        phases = _allreduce_phases(groups, cluster, algo)
        return _phases_time(phases, bytes_) if phases is not None else math.inf

    return min(_candidates(groups), key=seconds)


def _candidates(groups: Sequence[Sequence[int]]) -> list[str]:
    return ["ring", "hierarchical"] + (["tree"] if len(groups) == 1 else [])


def concurrent_allreduce_time(bytes_: float, groups: Sequence[Sequence[int]], cluster: Cluster,
                              algo: Algo = "auto") -> float:
    """Disjoint groups allreducing `bytes_` each at the same time (the segmented allreduce of
    channel/filter parallelism): every group's transfers share the links they use; the result is the
    slowest group. algo: ring, hierarchical (tree only for a single group); auto = fastest."""
    key = _groups_key(groups)
    _check_disjoint(key)
    if all(len(g) <= 1 for g in key) or bytes_ <= 0:
        return 0.0
    if algo == "auto" and (t := _measured("allreduce", bytes_, key, cluster)) is not None:
        return t
    names = _candidates(key) if algo == "auto" else [algo]
    if algo == "tree" and len(key) > 1:
        raise ValueError("tree allreduce is modelled for a single group only")
    best = math.inf
    for name in names:
        phases = _allreduce_phases(key, cluster, name)
        if phases is None:
            if algo != "auto":  # hierarchical asked for where it does not apply: it is the ring
                phases = _ring_phases(key, cluster)
            else:
                continue
        best = min(best, _phases_time(phases, bytes_))
    return best + _base(cluster, key)


# -- the other collectives -------------------------------------------------------------------------

def p2p_time(bytes_: float, a: int, b: int, cluster: Cluster) -> float:
    """alpha + n beta over the route a -> b (0 for a == b)."""
    if a == b or bytes_ <= 0:
        return 0.0
    return cluster.p2p_latency_s(a, b) + bytes_ / cluster.p2p_bw_Bps(a, b)


def reduce_scatter_time(bytes_total: float, ranks: Sequence[int], cluster: Cluster) -> float:
    """Ring reduce-scatter of a `bytes_total` input per rank (each keeps 1/p of the reduced result)."""
    return _ring_collective(bytes_total, ranks, cluster, "reduce_scatter")


def allgather_time(bytes_total: float, ranks: Sequence[int], cluster: Cluster) -> float:
    """Ring allgather whose gathered result is `bytes_total` per rank."""
    return _ring_collective(bytes_total, ranks, cluster, "allgather")


def concurrent_collective_time(kind: str, bytes_: float, groups: Sequence[Sequence[int]],
                               cluster: Cluster) -> float:
    """`kind` in several disjoint groups at once. Ring reduce-scatter/allgather and allreduce share
    links across the groups (e.g. the allgathers of all channel groups of a layer); broadcast and
    alltoall are taken group by group (the slowest), without cross-group contention."""
    key = _groups_key(groups)
    if all(len(g) <= 1 for g in key) or bytes_ <= 0:
        return 0.0
    if kind == "allreduce":
        return concurrent_allreduce_time(bytes_, key, cluster)
    if kind in ("broadcast", "alltoall"):
        return max(collective_time(kind, bytes_, g, cluster) for g in key)
    if kind not in _STEPS:
        raise ValueError(f"unknown collective kind {kind!r}")
    if (t := _measured(kind, bytes_, key, cluster)) is not None:
        return t
    parts = _cached(("rc", cluster.cache_key, key, kind),
                    lambda: _rings_phase(_ring_orders(key, cluster), kind, 1.0, cluster))
    return _phase_time(parts, bytes_) + _base(cluster, key)


def collective_time_fn(kind: str, groups: Sequence[Sequence[int]], cluster: Cluster,
                       algo: Algo = "auto") -> Callable[[float], float]:
    """`concurrent_collective_time(kind, n, groups, cluster)` (for an allreduce:
    `concurrent_allreduce_time(n, groups, cluster, algo)`) as a function of the bytes n, with the
    checks, ring orders and phases done once: the planner prices one group set at many sizes.
    Returns the same floats."""
    key = _groups_key(groups)
    if kind == "allreduce":
        _check_disjoint(key)
    elif algo != "auto":
        raise ValueError("algo applies to allreduce only")
    if all(len(g) <= 1 for g in key):
        return lambda n: 0.0
    if kind in ("broadcast", "alltoall"):
        return lambda n: 0.0 if n <= 0 else max(collective_time(kind, n, g, cluster) for g in key)
    if kind != "allreduce" and kind not in _STEPS:
        raise ValueError(f"unknown collective kind {kind!r}")
    sizes = {len(g) for g in key}
    fit = (cluster.measured_collective(kind, next(iter(sizes)))
           if cluster.measured_collectives and len(sizes) == 1 and algo == "auto" else None)
    base = _base(cluster, key)
    if kind != "allreduce":
        parts = _cached(("rc", cluster.cache_key, key, kind),
                        lambda: _rings_phase(_ring_orders(key, cluster), kind, 1.0, cluster))

        def ring_time(n: float) -> float:
            if n <= 0:
                return 0.0
            return fit.time_s(n) if fit is not None else _phase_time(parts, n) + base

        return ring_time
    if algo == "tree" and len(key) > 1:
        raise ValueError("tree allreduce is modelled for a single group only")
    options = []
    for name in _candidates(key) if algo == "auto" else [algo]:
        phases = _allreduce_phases(key, cluster, name)
        if phases is None:
            if algo == "auto":
                continue
            phases = _ring_phases(key, cluster)  # hierarchical where it does not apply
        options.append(phases)

    def allreduce(n: float) -> float:
        if n <= 0:
            return 0.0
        if fit is not None:
            return fit.time_s(n)
        best = math.inf
        for phases in options:
            best = min(best, _phases_time(phases, n))
        return best + base

    return allreduce


def _ring_collective(n: float, ranks: Sequence[int], cluster: Cluster, kind: str) -> float:
    return concurrent_collective_time(kind, n, [ranks], cluster)


def broadcast_time(bytes_: float, ranks: Sequence[int], cluster: Cluster,
                   algo: Literal["auto", "tree", "scatter_allgather"] = "auto") -> float:
    """Broadcast from ranks[0]: binomial tree, or scatter + ring allgather (better for large n)."""
    key = _groups_key([ranks])
    (g,) = key
    if len(g) <= 1 or bytes_ <= 0:
        return 0.0
    order = (g[0], *[r for r in ring_order(g, cluster) if r != g[0]])
    levels = list(reversed(_tree_levels(order)))  # root first

    def tree() -> _Affine:
        steps = [_step([(par, c, 1.0) for c, par in lvl], cluster) for lvl in levels]
        return _Affine(sum(s.a for s in steps), sum(s.b for s in steps))

    def scatter() -> _Affine:
        # Level k from the root forwards the half of the data its subtree needs: n / 2^(k+1).
        steps = [_step([(par, c, 0.5 ** (k + 1)) for c, par in lvl], cluster) for k, lvl in enumerate(levels)]
        ag = _rings_phase([ring_order(g, cluster)], "allgather", 1.0, cluster)[0]
        return _Affine(sum(s.a for s in steps) + ag.a, sum(s.b for s in steps) + ag.b)

    makers = {"tree": tree, "scatter_allgather": scatter}
    names = list(makers) if algo == "auto" else [algo]
    return min(_cached(("bc", cluster.cache_key, key, a), makers[a]).at(bytes_) for a in names) + \
        _base(cluster, key)


def alltoall_time(bytes_: float, ranks: Sequence[int], cluster: Cluster) -> float:
    """Pairwise-exchange alltoall: `bytes_` is one rank's whole send buffer (n/p to each peer);
    p-1 steps, in step i rank j sends to rank j+i."""
    key = _groups_key([ranks])
    (g,) = key
    p = len(g)
    if p <= 1 or bytes_ <= 0:
        return 0.0
    # measured in the runtime's convention: what a rank sends to the others, (p-1)/p of its buffer
    if (t := _measured("alltoall", bytes_ * (p - 1) / p, key, cluster)) is not None:
        return t

    def make() -> _Affine:
        steps = [_step([(g[j], g[(j + i) % p], 1.0 / p) for j in range(p)], cluster) for i in range(1, p)]
        return _Affine(sum(s.a for s in steps), sum(s.b for s in steps))

    return _cached(("a2a", cluster.cache_key, key), make).at(bytes_) + _base(cluster, key)


def collective_time(kind: str, bytes_: float, group: Sequence[int], cluster: Cluster) -> float:
    """Dispatch by name (allreduce, reduce_scatter, allgather, broadcast, alltoall, p2p/send)."""
    if kind == "allreduce":
        return allreduce_time(bytes_, group, cluster)
    if kind in ("reduce_scatter", "allgather"):
        return concurrent_collective_time(kind, bytes_, [group], cluster)
    if kind == "broadcast":
        return broadcast_time(bytes_, group, cluster)
    if kind == "alltoall":
        return alltoall_time(bytes_, group, cluster)
    if kind in ("p2p", "send", "recv"):
        a, b = group
        return p2p_time(bytes_, a, b, cluster)
    raise ValueError(f"unknown collective kind {kind!r}")
