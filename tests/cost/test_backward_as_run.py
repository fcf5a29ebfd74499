"""Backward priced as autograd runs it (issue 35's held-out CosmoFlow rows, `sample=2` over-predicted
+28% in three runs): an op on the model's inputs alone computes no input gradient, whatever its kind
(a Conv3d stem's backward-data was priced, 34 of the step's 165 ms at batch 4); a pooling the spatial
runtime splits runs its forward again in its backward (`parallel.styles.spatial._PoolOp`)."""

from __future__ import annotations

import pytest
import torch
from measured_ops import write_op_calibration
from torch import nn

from hybridpar.cluster import load_cluster
from hybridpar.cost.compute import op_time
from hybridpar.cost.spatial import RECOMPUTES_FORWARD, local_graph
from hybridpar.graph.tracing import trace
from hybridpar.layout import LayerLayout


def _device_and_calibration(graph, tmp_path):
    """forward t, backward-data 2t, backward-weight 3t per op (tests/cost/measured_ops.py)."""
    path = write_op_calibration(graph, tmp_path / "calibration.json", weight_factor=3.0)
    return load_cluster("localhost", gpus=2, calibration=path).device, path


def _conv3d_net() -> nn.Module:
    return nn.Sequential(nn.Conv3d(2, 8, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2),
                         nn.Conv3d(8, 8, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2),
                         nn.Flatten(), nn.Linear(64, 3))


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_a_conv3d_stem_is_priced_without_its_input_gradient(tmp_path):
    graph = trace(_conv3d_net(), (torch.randn(4, 2, 8, 8, 8),))
    dev, cal = _device_and_calibration(graph, tmp_path)
    first, second = [n for n in graph.nodes if n.op == "conv"]
    assert first.attr("input_grad") is False and second.attr("input_grad") is None
    t1, t2 = op_time(first, dev, calibration=cal), op_time(second, dev, calibration=cal)
    assert t1.source == t2.source == "measured"
    assert t1.bwd_data_s == 0 and t1.bwd_weight_s == pytest.approx(3 * t1.fwd_s)  # the weights' alone
    assert t2.bwd_data_s == pytest.approx(2 * t2.fwd_s)  # its input comes from the stem: computed
    # what autograd itself does: the stem's input gets no gradient, the second conv's does
    net, x = _conv3d_net(), torch.randn(4, 2, 8, 8, 8)
    seen = []
    net[3].register_full_backward_hook(lambda m, gin, gout: seen.append(gin[0] is not None))
    net[0].register_full_backward_hook(lambda m, gin, gout: seen.append(gin[0] is not None))
    net(x).sum().backward()
    assert seen == [True, False]


def test_an_op_on_the_input_alone_has_no_backward(tmp_path):
    """A pooling of the input (no parameters upstream): autograd never reaches it."""
    net = nn.Sequential(nn.MaxPool3d(2), nn.Conv3d(2, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 64, 3))
    graph = trace(net, (torch.randn(4, 2, 8, 8, 8),))
    dev, cal = _device_and_calibration(graph, tmp_path)
    pool = next(n for n in graph.nodes if n.op == "maxpool")
    t = op_time(pool, dev, calibration=cal)
    assert t.source == "measured" and t.fwd_s > 0 and t.bwd_s == 0


def test_a_spatially_split_pooling_pays_its_forward_again_in_backward(tmp_path):
    graph = trace(_conv3d_net(), (torch.randn(4, 2, 8, 8, 8),))
    dev, cal = _device_and_calibration(graph, tmp_path)
    local = local_graph(graph, LayerLayout(depth=2))
    pools = [n for n in local.nodes if n.op == "maxpool"]
    assert len(pools) == 2 and all(n.attr(RECOMPUTES_FORWARD) for n in pools)
    for piece in pools:
        t = op_time(piece, dev, sample_frac=0.5, calibration=cal)
        plain = op_time(graph.node(piece.name), dev, sample_frac=0.5, calibration=cal)  # sample=2: same work
        assert t.fwd_s == pytest.approx(plain.fwd_s)
        assert t.bwd_data_s == pytest.approx(plain.bwd_data_s + plain.fwd_s)
    # not under sample splits: the plain pooling keeps its indices
    assert not any(n.attr(RECOMPUTES_FORWARD) for n in graph.nodes)
