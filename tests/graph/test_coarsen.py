"""Coarsening keeps totals and acyclicity; fusing/collapsing do what they say."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpar.graph.coarsen import coarsen_to, collapse_chains, fuse_pointwise
from hybridpar.graph.models import load_model
from hybridpar.graph.tracing import trace
from hybridpar.graph.types import Graph, Node


def _check_invariants(fine: Graph, coarse: Graph) -> None:
    seen = set()
    for n in coarse.nodes:  # topologically ordered, hence acyclic
        assert set(n.inputs) <= seen and n.name not in n.inputs
        seen.add(n.name)
    assert coarse.params == fine.params
    assert coarse.fwd_flops == fine.fwd_flops and coarse.bwd_flops == fine.bwd_flops
    members = [m for n in coarse.nodes for m in (n.attr("members") or (n.name,))]
    assert sorted(members) == sorted(n.name for n in fine.nodes)  # a partition of the fine nodes
    # Every fine edge between different groups is a coarse edge.
    group = {m: n.name for n in coarse.nodes for m in (n.attr("members") or (n.name,))}
    coarse_edges = set(coarse.edges())
    for a, b in fine.edges():
        if group[a] != group[b]:
            assert (group[a], group[b]) in coarse_edges


@pytest.fixture(scope="module")
def small_resnet():
    lm = load_model("small_resnet", batch=2, device="meta")
    return trace(lm.module, lm.example_inputs, "small_resnet")


def test_fuse_pointwise_folds_bn_relu_into_convs(small_resnet):
    f = fuse_pointwise(small_resnet)
    _check_invariants(small_resnet, f)
    assert not any(n.op in ("batchnorm", "relu") and len(n.attr("members")) == 1
                   and small_resnet.node(n.inputs[0]).op == "conv2d" for n in f.nodes)
    conv1 = f.node("conv1")
    assert conv1.op == "conv2d" and conv1.attr("ops") == ("conv2d", "batchnorm", "relu")
    assert conv1.module == "conv1" and conv1.attr("modules") == ("conv1", "bn1", "relu")
    assert conv1.attr("kernel") == (3, 3) and conv1.out_shape == small_resnet.node("relu").out_shape
    # The residual add (two inputs) stays separate.
    assert sum(n.op == "add" for n in f.nodes) == 3


def test_collapse_chains_merges_a_sequential_model():
    lm = load_model("vgg16", batch=1, device="meta")
    g = trace(lm.module, lm.example_inputs, "vgg16")
    c = collapse_chains(g)
    _check_invariants(g, c)
    assert next(n.op for n in c.nodes) == "input" and len(c) == 2
    # coarsen_to stops at the limit instead: a placer can still split the chain.
    assert coarsen_to(g, 100) is g
    ten = coarsen_to(g, 10)
    assert len(ten) == 10
    _check_invariants(g, ten)


@pytest.mark.parametrize("name,limit", [("inception_v3", 30), ("resnet50", 12), ("gnmt", 8)])
def test_coarsen_to_limit(name, limit):
    lm = load_model(name, batch=2, device="meta", input_shape=(8,) if name == "gnmt" else None)
    g = trace(lm.module, lm.example_inputs, name)
    c = coarsen_to(g, limit)
    assert len(c) <= limit
    _check_invariants(g, c)
    if name == "resnet50":  # module-prefix grouping: the convs of a residual block stay together
        def block_convs(n):
            return {".".join(m.split(".")[:2]) for m in n.attr("modules") if m.startswith("layer") and ".conv" in m}
        owners = {}
        for n in c.nodes:
            for b in block_convs(n):
                owners.setdefault(b, set()).add(n.name)
        assert len(owners) == 16 and all(len(v) == 1 for v in owners.values())


@st.composite
def random_dags(draw):
    n = draw(st.integers(2, 25))
    n_inputs = draw(st.integers(1, 2))
    nodes = []
    for i in range(n):
        if i < n_inputs:
            nodes.append(Node(f"n{i}", "input", out_shape=(1,)))
            continue
        preds = draw(st.sets(st.integers(0, i - 1), min_size=1, max_size=3))
        op = draw(st.sampled_from(["conv2d", "relu", "batchnorm", "add", "linear", "concat"]))
        nodes.append(Node(f"n{i}", op, tuple(f"n{p}" for p in sorted(preds)), out_shape=(1, i),
                          param_shapes=(("w", (draw(st.integers(0, 5)),)),),
                          fwd_flops=draw(st.integers(0, 100)), bwd_data_flops=draw(st.integers(0, 100)),
                          bwd_weight_flops=draw(st.integers(0, 100)),
                          attrs=(("scope", draw(st.sampled_from(["a.x", "a.y", "b", None]))),)))
    return Graph("random", tuple(nodes)), n_inputs


@settings(max_examples=60, deadline=None)
@given(random_dags(), st.integers(1, 10))
def test_coarsening_preserves_totals_and_acyclicity(dag, limit):
    g, n_inputs = dag
    for coarse in (fuse_pointwise(g), collapse_chains(g), coarsen_to(g, limit)):
        _check_invariants(g, coarse)
    assert len(coarsen_to(g, limit)) <= max(limit, n_inputs + 1)
