"""Memory of a uniform spatial layout (cost.memory.predict_rank_memory over cost.spatial.local_graph):
the rank's activation pieces plus each convolution's kept input window (the halo buffer), weights
whole; checked against element counts worked out by hand."""

import pytest
import torch
from torch import nn

from hybridpar.cost.memory import predict_rank_memory
from hybridpar.cost.spatial import local_graph
from hybridpar.graph.tracing import trace
from hybridpar.layout import LayerLayout


def _two_convs():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1, bias=False))
    return trace(m, torch.randn(2, 3, 8, 8), "two_convs")


def test_height2_activations_by_hand():
    g = _two_convs()
    mem = predict_rank_memory(g, "height=2", framework_bytes=0)
    # rank 0 holds rows 0..3 of 8; conv1's output rows 0..3 read input rows -1..4: a 6-row window of
    # the input (edge padding row included), kept by conv1: 2 x 3 x 6 x 8 = 288 elements; the ReLU
    # keeps its output piece 2 x 4 x 4 x 8 = 256; conv2's window of it, 2 x 4 x 6 x 8 = 384.
    assert mem.activations_bytes == (288 + 256 + 384) * 4
    assert mem.weights_bytes == (4 * 3 * 9 + 4 * 4 * 9) * 4  # whole on every rank
    whole = predict_rank_memory(g, "sample=1", framework_bytes=0)
    # one process keeps the ReLU's output, 2 x 4 x 8 x 8 (the input batch is io_bytes, not an activation;
    # under the spatial layout conv1's window is a new tensor, so it counts)
    assert whole.activations_bytes == 512 * 4
    assert mem.weights_bytes == whole.weights_bytes


def test_sample_times_height_and_width():
    g = _two_convs()
    mem = predict_rank_memory(g, LayerLayout(sample=2, height=2, width=2), framework_bytes=0)
    # 1 sample; 4 x 4 pieces; windows 6 x 6 (padding row and column at the corner): 3*36 + 4*16 + 4*36
    assert mem.activations_bytes == (108 + 64 + 144) * 4
    assert mem.buckets_bytes == mem.grads_bytes > 0  # gradients summed over the 8 ranks: bucketed


def test_local_graph_shapes_and_flops():
    g = _two_convs()
    loc = local_graph(g, LayerLayout(height=2))
    conv = loc.node(g.nodes[1].name)
    assert conv.in_shapes[0] == (4, 3, 6, 8) and conv.out_shape == (4, 4, 4, 8)  # batch x 2 ranks
    assert conv.fwd_flops == g.nodes[1].fwd_flops  # half the rows, twice the (virtual) batch
    assert sum(n.attr("halo") is True for n in loc.nodes) == 2


def test_spatial_layout_must_be_uniform():
    g = _two_convs()
    with pytest.raises(ValueError, match="uniformly"):
        predict_rank_memory(g, "height=2", layers={g.nodes[1].module or "0": LayerLayout(sample=2)})
