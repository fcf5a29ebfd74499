"""`hybridpar profile`'s measurements of the channel/filter/sample runtime itself, on PyTorch's fake
process group: its overhead per node and per split layer, and its split layers timed as run."""

from __future__ import annotations

import pytest

from hybridpar.cost.compute import local_shapes, variant_name
from hybridpar.profile.dist_layers import dist_jobs, measure_dist_layers
from hybridpar.profile.ops import OpSpec
from hybridpar.profile.runtime_overhead import runtime_overhead

CONV = OpSpec("conv2d", (8, 8, 8, 8), (8, 8, 3, 3), (8, 8, 8, 8), padding=(1, 1))
LINEAR = OpSpec("linear", (8, 16), (6, 16), (8, 6), bias=True)


def test_jobs_cover_every_channel_filter_layout_of_each_split():
    jobs = dist_jobs([CONV], (4,))
    # k=4: (1,2,2), (1,4,1), (1,1,4), (2,2,1), (2,1,2); world = channel x filter; with and without dx
    assert {w: len(j) for w, j in jobs.items()} == {4: 6, 2: 4}
    half = next(j for j in jobs[2] if j["sample"] == 2 and j["channel"] == 2 and j["input_grad"])
    assert half["key"] == local_shapes(CONV.node(), 0.5, 0.5, 1.0).key(variant_name("conv2d", 2, 1))


@pytest.mark.timeout(120)
def test_split_layers_are_timed_as_the_runtime_runs_them():
    recs = measure_dist_layers([CONV, LINEAR], (2,), warmup=1, repeats=3)
    names = {r.op for r in recs.values()}
    assert names == {variant_name(op, c, f, g) for op in ("conv2d", "linear") for c, f in ((2, 1), (1, 2))
                     for g in (True, False)}
    for r in recs.values():  # the whole backward sits in bwd_weight (the first-layer rule drops bwd_data)
        assert r.fwd.median_s > 0 and r.bwd_weight.median_s > 0 and r.bwd_data.median_s == 0


@pytest.mark.timeout(120)
def test_runtime_overhead_is_measured_per_node_and_per_split_layer():
    got = runtime_overhead(repeats=3, rounds=1)
    # 8 x (conv, bn, relu [+ 4 relu]), pool, flatten, linear; "S": 8 x (3x3 conv, relu), the same head
    assert got["nodes"] == {"A": 27, "B": 59, "S": 19}
    for key in ("sample_node_s", "dtensor_node_s", "layer_s", "spatial_op_s"):
        assert len(got[key]) == 2 and min(got[key]) >= 0
    # a split layer's wrapper, autograd Function and collective bookkeeping: at least 50 us per step on
    # any CPU this runs on (measured 0.5-1 ms here); the collectives' own calls were counted
    assert sum(got["layer_s"]) > 50e-6
    assert got["collectives_per_step"]["channel=2A"] > 8
    # a convolution exchanging a halo (height=2): _HaloOp's sends and receives, interior and boundary
    # convolutions, the window re-assembled in backward: at least 50 us (measured ~0.9 ms here)
    assert sum(got["spatial_op_s"]) > 50e-6
    assert got["collectives_per_step"]["height=2S"] >= 16  # a halo each way per convolution
    # a DTensor redistribution (each way of a Shard <-> Replicate hop, forward and backward): at least
    # 20 us of DTensor's Python (measured ~0.15 ms here); the chains without hops run none
    hops = got["redistributions_per_step"]
    assert hops["R24"] - hops["R8"] == 4 * 16 and hops["M24"] == hops["M8"] == 0
    assert got["redistribute_s"] > 20e-6
    # the layout chains' own redistributions are counted (and taken out of the per-node and per-layer
    # terms: the dry run prices each one): none without DTensor, some at the spatial chain's head
    assert hops["sample=2A_step"] == 0 and hops["height=2S_step"] > 0
