"""The per-layer planner prices the channel/filter/sample runtime's own work on localhost: per graph
node (DTensor dispatch under a channel/filter split), per split conv/linear (its wrapper), or, where
`hybridpar profile --splits` timed the runtime's layer itself, that record instead."""

from __future__ import annotations

import pytest

from hybridpar.cluster.calibration import Calibration, Measurement, OpRecord, RuntimeOverhead, save_calibration
from hybridpar.cost.compute import local_shapes, variant_name
from hybridpar.graph.models import load_model
from hybridpar.graph.tracing import trace
from hybridpar.search.layers.planner import plan_model

OVERHEAD = RuntimeOverhead(sample_node_fwd_s=1e-5, sample_node_bwd_s=2e-5, dtensor_node_fwd_s=1e-4,
                           dtensor_node_bwd_s=2e-4, layer_fwd_s=1e-3, layer_bwd_s=3e-3,
                           spatial_op_fwd_s=2e-3, spatial_op_bwd_s=5e-3)


def _m(s: float) -> Measurement:
    return Measurement(median_s=s, p10_s=s, p90_s=s, repeats=1)


def _cal(tmp_path, name: str, **fields):
    path = tmp_path / f"{name}.json"
    save_calibration(Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10, **fields), path)
    return path


def _plan(path, monkeypatch, strategy: str, ranks: int = 2):
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(path))
    return plan_model("small_cnn", "localhost", ranks, 32, strategy=strategy)


def _graph():
    m = load_model("small_cnn", batch=32)
    return trace(m.module, m.example_inputs)


@pytest.mark.parametrize("strategy", ["channel=2", "filter=2", "sample=2"])
def test_every_node_and_split_layer_pays_the_measured_overhead(tmp_path, monkeypatch, strategy):
    bare = _plan(_cal(tmp_path, "bare"), monkeypatch, strategy)
    priced = _plan(_cal(tmp_path, "priced", runtime_overhead=OVERHEAD), monkeypatch, strategy)
    nodes = sum(n.op != "input" for n in _graph().nodes)  # what the planner prices: every op node
    o = OVERHEAD
    if strategy == "sample=2":  # no DTensor, no split layer
        want = nodes * (o.sample_node_fwd_s + o.sample_node_bwd_s)
    else:  # 4 convs and the linear are split; every node runs on DTensors
        want = nodes * (o.dtensor_node_fwd_s + o.dtensor_node_bwd_s) + 5 * (o.layer_fwd_s + o.layer_bwd_s)
    got = priced.prediction.compute_s - bare.prediction.compute_s
    assert got == pytest.approx(want, rel=1e-6)


def test_every_convolution_exchanging_a_halo_pays_the_spatial_runtime(tmp_path, monkeypatch):
    """height=2 on small_cnn (32x32 images, two 3x3 convolutions before its pools... every conv and
    pool whose window crosses the rows' cut): the spatial runtime's measured work per exchanging op
    (forward and backward) on top of the per-node overhead."""
    from hybridpar.cost.spatial import SLIDING, halo_cost
    from hybridpar.layout.layer import LayerLayout

    no_spatial = OVERHEAD.model_copy(update={"spatial_op_fwd_s": 0.0, "spatial_op_bwd_s": 0.0})
    bare = _plan(_cal(tmp_path, "bare", runtime_overhead=no_spatial), monkeypatch, "height=2")
    priced = _plan(_cal(tmp_path, "priced", runtime_overhead=OVERHEAD), monkeypatch, "height=2")
    from hybridpar.cluster import load_cluster

    cl, lay = load_cluster("localhost", gpus=2), LayerLayout(height=2)
    exchanging = sum(1 for n in _graph().nodes if n.op in SLIDING and halo_cost(n, lay, cl, 4)[2] > 0)
    assert exchanging >= 2
    want = exchanging * (OVERHEAD.spatial_op_fwd_s + OVERHEAD.spatial_op_bwd_s) * cl.device.time_share
    assert priced.prediction.compute_s - bare.prediction.compute_s == pytest.approx(want, rel=1e-6)


def test_a_record_of_the_runtime_layer_replaces_the_op_and_its_overhead(tmp_path, monkeypatch):
    g = _graph()
    conv = next(n for n in g.nodes if n.op == "conv2d" and n.bwd_data_flops > 0)  # not the first layer
    loc = local_shapes(conv, 1.0, 0.5, 1.0)
    key = loc.key(variant_name("conv2d", 2, 1))
    rec = OpRecord(key=key, op=key.split("|")[0], fwd=_m(0.25), bwd_data=_m(0.0), bwd_weight=_m(0.5))
    base = _plan(_cal(tmp_path, "base", runtime_overhead=OVERHEAD), monkeypatch, "channel=2")
    timed = _plan(_cal(tmp_path, "timed", runtime_overhead=OVERHEAD, ops={key: rec}), monkeypatch, "channel=2")
    layer = conv.module
    was, now = base.prediction.per_layer[layer], timed.prediction.per_layer[layer]
    plain = was["fwd_s"] + was["bwd_s"]
    # the record's 0.75 s stands for the conv, its DTensor node and its layer overhead; the
    # followers' share is unchanged
    from hybridpar.cluster import load_cluster
    from hybridpar.cost.compute import op_time

    dev = load_cluster("localhost", gpus=2).device
    t = op_time(conv, dev, channel_frac=0.5, calibration=tmp_path / "base.json")
    conv_alone = t.total_s + OVERHEAD.dtensor_node_fwd_s + OVERHEAD.dtensor_node_bwd_s \
        + OVERHEAD.layer_fwd_s + OVERHEAD.layer_bwd_s
    assert now["fwd_s"] + now["bwd_s"] == pytest.approx(plain - conv_alone + 0.75, rel=1e-6)
    assert plain < 0.75
    # and the first layer looks up its own record, without the input gradient
    first = next(n for n in g.nodes if n.op == "conv2d")
    assert first.bwd_data_flops == 0
    assert variant_name("conv2d", 2, 1, first.bwd_data_flops > 0).endswith("/nodx")


def test_gpu_presets_are_priced_without_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(_cal(tmp_path, "priced", runtime_overhead=OVERHEAD)))
    a = plan_model("small_cnn", "dgx1-v100", 2, 32, strategy="channel=2")
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(_cal(tmp_path, "bare")))
    b = plan_model("small_cnn", "dgx1-v100", 2, 32, strategy="channel=2")
    assert a.prediction.compute_s == b.prediction.compute_s
