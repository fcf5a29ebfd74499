"""The planner's fast paths give the same numbers as the plain ones (no timings here: benchmarks/
bench_planner.py measures them): the vectorised collective model against the scalar one on every
preset, the translated ring orders, the rank groups built with numpy, and the layer-cost memo."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from hybridpar.cluster import load_cluster
from hybridpar.cost import collectives as co
from hybridpar.plans import LayerLayout
from hybridpar.search.layers import decomposition as dec
from hybridpar.search.layers.layer_cost import CostContext, weight_layer_cost

PRESETS = ["lassen", "dgx1-v100", "dgx-a100", "dgx-h100"]


def _reference_order(ranks, cluster):
    by_node: dict[int, list[int]] = {}
    for r in ranks:
        by_node.setdefault(cluster.node_of(r), []).append(r)
    out: list[int] = []
    for node in sorted(by_node):
        out.extend(co._best_node_order(tuple(sorted(by_node[node])), cluster))
    return tuple(out)


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("gpus", [8, 64, 512])
def test_vectorised_ring_phases_equal_the_scalar_ones(name, gpus):
    cl = load_cluster(name, gpus)
    assert co._route_table(cl) is not None
    rng = random.Random(gpus)
    layouts = [lay for lay in dec.all_layouts(gpus) if lay.channel * lay.filter > 1]
    sets = [dec.filter_groups(lay) for lay in layouts] + [dec.channel_groups(lay) for lay in layouts]
    sets += [dec.shard_groups(LayerLayout(sample=lay.sample, channel=lay.channel * lay.filter)) for lay in layouts]
    for _ in range(10):  # irregular groups too
        k, size = rng.choice([1, 2, 3, 8]), rng.choice([2, 3, 4, 5])
        ranks = rng.sample(range(gpus), min(gpus, k * size))
        sets.append(tuple(tuple(ranks[i::k]) for i in range(k)))
    for groups in rng.sample(sets, min(len(sets), 40)):
        rings = co._ring_orders(groups, cl)
        assert rings == [_reference_order(g, cl) for g in groups]
        rings = [r for r in rings if len(r) > 1]
        if not rings:
            continue
        for kind in ("allreduce", "reduce_scatter", "allgather"):
            fast = co._rings_phase(rings, kind, 0.5, cl)
            slow = co._rings_phase_scalar(rings, kind, 0.5, cl)
            assert set(fast) == set(slow)
            for n in (0.0, 1.0, 4096.0, 3e8):
                assert co._phase_time(fast, n) == co._phase_time(slow, n)


@pytest.mark.parametrize("name", PRESETS)
def test_vectorised_step_equals_the_scalar_one(name):
    cl = load_cluster(name, 512)
    rng = random.Random(3)
    for _ in range(20):
        flows = [(*rng.sample(range(512), 2), rng.choice([1.0, 0.5, 0.125])) for _ in range(rng.choice([16, 200]))]
        load = Counter(link for s, d, _ in flows for link in cl.route(s, d).links)
        assert co._step(flows, cl) == co._step(flows, cl, load)


@pytest.mark.parametrize("name", PRESETS)
def test_collective_time_fn_equals_the_direct_call(name):
    cl = load_cluster(name, 256)
    lay = LayerLayout(sample=64, channel=2, filter=2)
    replica = dec.shard_groups(LayerLayout(sample=64, channel=4))
    for groups in (dec.filter_groups(lay), dec.channel_groups(lay), replica):
        for n in (0, 1, 1000, 10**6, 10**9):
            assert co.collective_time_fn("allgather", groups, cl)(n) == co.concurrent_collective_time(
                "allgather", n, groups, cl)
            assert co.collective_time_fn("reduce_scatter", groups, cl)(n) == co.concurrent_collective_time(
                "reduce_scatter", n, groups, cl)
            for algo in ("auto", "ring", "hierarchical"):
                assert co.collective_time_fn("allreduce", groups, cl, algo)(n) == co.concurrent_allreduce_time(
                    n, groups, cl, algo)


def test_rank_groups_built_with_numpy_equal_the_rank_convention():
    for n in (1, 2, 6, 12, 64, 256):
        for lay in dec.all_layouts(n):
            c, f, g = lay.channel, lay.filter, lay.channel * lay.filter
            assert dec.filter_groups(lay) == tuple(tuple(range(b, b + f)) for b in range(0, n, f))
            assert dec.channel_groups(lay) == tuple(tuple(base + j + i * f for i in range(c))
                                                    for base in range(0, n, g) for j in range(f))
            assert dec.shard_groups(lay) == tuple(tuple(range(k, n, g)) for k in range(g))
            assert all(type(r) is int for grp in dec.channel_groups(lay) for r in grp)


def test_identical_layers_share_one_cost_and_it_is_theirs():
    from hybridpar.search.layers import planner
    from hybridpar.search.layers.layer_graph import build_layer_graph

    graph, _ = planner._traced_spec("resnet50", None)
    lg = build_layer_graph(planner._scaled(graph, 64))
    ctx = CostContext(load_cluster("lassen", 16), 64, 16)
    lay = LayerLayout(sample=4, channel=2, filter=2)
    opts = planner._options(lg, ctx, float("inf"), [lay], even_only=False)
    weights = [v for v in lg.vertices if v.is_weight]
    assert len(ctx.layer_memo) < len(weights) + len(lg.vertices) - len(weights)  # shared entries
    fresh = CostContext(load_cluster("lassen", 16), 64, 16)
    for vo in opts:
        if vo.vertex.is_weight:
            assert vo.costs[0] == weight_layer_cost(vo.vertex.node, vo.vertex.followers, lay, fresh,
                                                    input_grad=vo.vertex.input_grad)
