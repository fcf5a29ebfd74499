"""The analytic collectives of hybridpar.cost.layout_comm against the algorithms' definitions."""

from __future__ import annotations

import math

import torch
from torch import nn

from hybridpar.cost.layout_comm import bytes_by_kind, layer_collectives, model_collectives
from hybridpar.graph.tracing import trace
from hybridpar.plans import LayerLayout


def _graph():
    net = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(8, 10))
    return trace(net, torch.randn(16, 4, 8, 8))


def _conv(graph, i):
    return [n for n in graph.nodes if n.op == "conv2d"][i]


def test_stationary_x_reduce_scatters_y_and_gathers_dy():
    g = _graph()
    conv = _conv(g, 1)  # 8 -> 8 channels, 8x8 -> 4x4, 16 samples
    ops = layer_collectives(conv, LayerLayout(channel=4))
    y_bytes = 16 * 8 * 4 * 4 * 4
    assert [(o.kind, o.group_size, o.bytes_) for o in ops] == [
        ("reduce_scatter", 4, y_bytes), ("allgather", 4, y_bytes)]


def test_stationary_y_gathers_x_and_reduce_scatters_dx():
    g = _graph()
    conv = _conv(g, 1)
    ops = layer_collectives(conv, LayerLayout(filter=4))
    x_bytes = 16 * 8 * 8 * 8 * 4
    assert [(o.kind, o.bytes_) for o in ops] == [("allgather", x_bytes), ("reduce_scatter", x_bytes)]
    assert [o.kind for o in layer_collectives(conv, LayerLayout(filter=4), input_grad=False)] == ["allgather"]


def test_segmented_allreduce_carries_one_shard():
    g = _graph()
    conv = _conv(g, 1)  # weight 8x8x3x3 + bias 8
    full = layer_collectives(conv, LayerLayout(sample=4))
    seg = layer_collectives(conv, LayerLayout(sample=2, channel=2))
    assert [o.bytes_ for o in full if o.phase == "grad"] == [(8 * 8 * 9 + 8) * 4]
    assert [(o.group_size, o.bytes_) for o in seg if o.phase == "grad"] == [(2, (8 * 4 * 9 + 4) * 4)]


def test_first_layer_has_no_input_gradient_exchange():
    g = _graph()
    ops = dict(model_collectives(g, LayerLayout(filter=2)))
    first = [op for name, op in model_collectives(g, LayerLayout(filter=2)) if name == _conv(g, 0).name]
    assert [o.kind for o in first] == ["allgather"]
    assert ops  # the rest of the model communicates too


def test_sample_only_is_gradients_bn_and_loss():
    g = _graph()
    totals = bytes_by_kind(model_collectives(g, LayerLayout(sample=4)))
    params = sum(n.params for n in g.nodes) * 4
    assert set(totals) == {"allreduce"}
    # grads, BN fwd ((count, count*mean, M2, count*mean^2) in float64: not growing with the replicas),
    # BN bwd (sum dy, sum dy*xhat), loss
    assert totals["allreduce"] == params + (3 * 8 + 1) * 8 + 2 * 8 * 4 + 4


def test_whole_outputs_gather_over_the_sample_groups():
    """The API's global form (whole outputs on every rank) instead of hybridpar train's loss allreduce."""
    g = _graph()
    totals = bytes_by_kind(model_collectives(g, LayerLayout(sample=4), whole_outputs=True))
    params = sum(n.params for n in g.nodes) * 4
    last = [n for n in g.nodes if n.op not in ("input", "output")][-1]
    assert totals["allreduce"] == params + (3 * 8 + 1) * 8 + 2 * 8 * 4  # grads, BN fwd, BN bwd
    assert totals["allgather"] == math.prod(last.out_shape) * 4  # the outputs
