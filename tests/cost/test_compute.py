import math

import pytest

from hybridpar.cluster import load_cluster
from hybridpar.cluster.calibration import Calibration, Measurement, OpRecord
from hybridpar.cost.compute import efficiency_table, local_shapes, op_time, roofline_time, size_factor
from hybridpar.graph.types import Node


def conv(n=64, c=256, f=256, hw=56, first=False) -> Node:
    flops = 2 * n * c * f * 9 * hw * hw
    return Node(name="conv", op="conv2d", inputs=("x",), in_shapes=((n, c, hw, hw),), out_shape=(n, f, hw, hw),
                param_shapes=(("weight", (f, c, 3, 3)),), fwd_flops=flops,
                bwd_data_flops=0 if first else flops, bwd_weight_flops=flops)


def relu(shape=(64, 256, 56, 56)) -> Node:
    return Node(name="relu", op="relu", inputs=("x",), in_shapes=(shape,), out_shape=shape,
                fwd_flops=math.prod(shape), bwd_data_flops=math.prod(shape))


@pytest.fixture(scope="module")
def v100():
    return load_cluster("dgx1-v100").device


def test_roofline_is_the_documented_formula(v100):
    node = conv()
    eff = efficiency_table()["gpu"]
    e = eff["classes"]["conv2d"]
    byts = 4 * (math.prod(node.in_shapes[0]) + node.params + node.out_numel)
    # the size factor of the forward GEMM: 1.2e11 FLOPs (large), min(M, N) = 256 filters (a little thin)
    k = size_factor("conv2d", v100, "fp32", node.fwd_flops, thin=256)
    assert 0.85 < k < 1
    want = max(node.fwd_flops / (v100.peak("fp32") * e["compute"] * k), byts / (v100.mem_bw_Bps * e["memory"]))
    assert op_time(node, v100).fwd_s == pytest.approx(want + eff["launch_s"])
    r = relu()
    e = eff["classes"]["elementwise"]
    assert op_time(r, v100).fwd_s == pytest.approx(
        8 * r.out_numel / (v100.mem_bw_Bps * e["memory"]) + eff["launch_s"])  # bandwidth-bound


def test_fractions_cut_the_local_shape(v100):
    node = conv()
    full = op_time(node, v100)
    for kw in ({"sample_frac": 0.5}, {"channel_frac": 0.5}):  # large pieces, the GEMM no thinner
        half = op_time(node, v100, **kw)
        assert half.fwd_s == pytest.approx(full.fwd_s / 2, rel=0.01), kw  # compute-bound conv
    # half the filters: a thinner forward GEMM (N = 128) runs less efficiently than the whole
    assert op_time(node, v100, filter_frac=0.5).fwd_s > 1.02 * full.fwd_s / 2
    loc = local_shapes(node, channel_frac=1 / 3)  # 256 channels over 3 ranks: largest shard 86
    assert loc.x[1] == 86 and loc.w == (256, 86, 3, 3) and loc.y == node.out_shape
    assert loc.flop_frac == pytest.approx(86 / 256)
    loc = local_shapes(node, 0.25, 0.5, 0.5)
    assert (loc.x, loc.w, loc.y) == ((16, 128, 56, 56), (128, 128, 3, 3), (16, 128, 56, 56))
    with pytest.raises(ValueError):
        local_shapes(node, channel_frac=0)


def test_tensor_cores_and_passes(v100):
    node = conv()
    assert op_time(node, v100, dtype="fp16").fwd_s < op_time(node, v100).fwd_s / 4
    assert op_time(conv(first=True), v100).bwd_data_s == 0  # first layer: no grad wrt the input
    t = op_time(node, v100)
    assert t.bwd_s == t.bwd_data_s + t.bwd_weight_s and t.total_s == t.fwd_s + t.bwd_s
    assert op_time(relu(), v100).bwd_weight_s == 0
    assert op_time(node, load_cluster("dgx1-v100")) == t  # a Cluster is accepted for its device


def _m(s):
    return Measurement(median_s=s, p10_s=s, p90_s=s, repeats=3)


def test_measured_table_first_then_scaled_then_roofline():
    node = conv(n=8, c=16, f=16, hw=8)
    key = local_shapes(node).key("conv2d")
    cal = Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e9,
                      ops={key: OpRecord(key=key, op="conv2d", fwd=_m(1e-3), bwd_data=_m(2e-3), bwd_weight=_m(3e-3))})
    cpu = load_cluster("localhost", gpus=2, calibration="/nonexistent/calibration.json").device
    t = op_time(node, cpu, calibration=cal)
    assert (t.fwd_s, t.bwd_data_s, t.bwd_weight_s, t.source) == (1e-3, 2e-3, 3e-3, "measured")
    # Same op at half the batch: scaled from the measured row.
    half = op_time(node, cpu, sample_frac=0.5, calibration=cal)
    assert half.source == "measured-scaled" and half.fwd_s == pytest.approx(0.5e-3)
    # Four ranks on two cores time-share: measured single-rank times stretch by 2.
    cpu4 = load_cluster("localhost", gpus=4, calibration="/nonexistent/calibration.json").device
    assert cpu4.time_share == 2
    assert op_time(node, cpu4, calibration=cal).fwd_s == pytest.approx(2e-3)
    # A shape the table lacks, or another device, falls back to the roofline.
    assert op_time(node, cpu, channel_frac=0.5, calibration=cal).source == "roofline"
    assert op_time(node, load_cluster("dgx1-v100").device, calibration=cal).source == "roofline"
    # The first layer's measured backward-data is not run in training (no grad wrt the input).
    first = conv(n=8, c=16, f=16, hw=8, first=True)
    assert op_time(first, cpu, calibration=cal).bwd_data_s == 0
    assert roofline_time(node, cpu4).fwd_s == pytest.approx(2 * roofline_time(node, cpu).fwd_s)
