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
    # rank 0 holds rows 0..3 of 8; conv1's output rows 0..3 read input rows -1..4: the edge padding row
    # (made locally), its own rows and row 4 from rank 1. conv1 keeps its input piece, a copy cut from
    # the whole batch (2 x 3 x 4 x 8 = 192), and the received row (2 x 3 x 1 x 8 = 48), not the window;
    # the ReLU keeps its output piece 2 x 4 x 4 x 8 = 256, which conv2 keeps too (the same storage),
    # plus its received row 2 x 4 x 1 x 8 = 64.
    assert mem.activations_bytes == (192 + 48 + 256 + 64) * 4
    assert mem.weights_bytes == (4 * 3 * 9 + 4 * 4 * 9) * 4  # whole on every rank
    whole = predict_rank_memory(g, "sample=1", framework_bytes=0)
    # one process keeps the ReLU's output, 2 x 4 x 8 x 8 (the input batch is io_bytes, not an activation)
    assert whole.activations_bytes == 512 * 4
    assert mem.weights_bytes == whole.weights_bytes


def test_sample_times_height_and_width():
    g = _two_convs()
    mem = predict_rank_memory(g, LayerLayout(sample=2, height=2, width=2), framework_bytes=0)
    # 1 sample; 4 x 4 pieces. conv1: the input piece 3 x 16 = 48, one row from the height neighbour
    # (3 x 1 x 4 = 12), then one column of the height-extended window (6 rows with the padding row:
    # 3 x 6 x 1 = 18); the ReLU's piece 4 x 16 = 64; conv2's received row and column 4 x (4 + 6) = 40
    assert mem.activations_bytes == (48 + 12 + 18 + 64 + 40) * 4
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


@pytest.mark.slow  # two ranks and one process, a small U-Net: about 15 s here
def test_height2_step_memory_measured_against_one_process_and_the_prediction():
    # what a training step allocates (the CPU allocator's own events: hybridpar.profile.step_memory)
    # on each rank of height=2, against one process and against cost.memory's prediction. Each
    # convolution keeps its input piece (its producer's storage) and the halo rows, not a copy of its
    # window (hybridpar.parallel.styles.spatial._HaloOp): with the window kept a rank held about one
    # whole process's activations (1.0x here), and the prediction counts what the runtime keeps.
    from hybridpar.profile.step_memory import Case, compare

    case = Case("unet", (3, 96, 64), 1, (("base", 8), ("depth", 2)))
    got = compare(case, ["height=2"])
    one, h2 = got["one"], got["height=2"]
    assert h2["vs_one"] <= 0.6, got
    for r in (one, h2):
        assert abs(r["peak_bytes"] / r["predicted_bytes"] - 1) <= 0.15, got
