"""Issue 13 item 4: splitting costs efficiency. A piece's compute runs at its op class's efficiency
times a size factor of its own shape: GPUs from DeepBench's V100 GEMM/convolution measurements
(cost/size_efficiency.yaml), localhost from measured records per local shape, else from the matmul
rate-vs-size curve `hybridpar profile` measures."""

from __future__ import annotations

import math

import pytest
import yaml

from hybridpar.cluster import load_cluster
from hybridpar.cluster.calibration import Calibration, Measurement, OpRecord
from hybridpar.cost.compute import (
    SIZE_EFFICIENCY_FILE,
    curve_factor,
    local_shapes,
    monotone_curve,
    op_time,
    size_curve,
    size_factor,
)
from hybridpar.graph.types import Node


def conv(n, c, f, hw) -> Node:
    flops = 2 * n * c * f * 9 * hw * hw
    return Node(name="conv", op="conv2d", inputs=("x",), in_shapes=((n, c, hw, hw),), out_shape=(n, f, hw, hw),
                param_shapes=(("weight", (f, c, 3, 3)),), fwd_flops=flops, bwd_data_flops=flops,
                bwd_weight_flops=flops)


def linear(rows, c, f) -> Node:
    flops = 2 * rows * c * f
    return Node(name="fc", op="linear", inputs=("x",), in_shapes=((rows, c),), out_shape=(rows, f),
                param_shapes=(("weight", (f, c)),), fwd_flops=flops, bwd_data_flops=flops, bwd_weight_flops=flops)


@pytest.fixture(scope="module")
def v100():
    return load_cluster("dgx1-v100").device


def test_curves_are_the_data_file_made_monotone():
    data = yaml.safe_load(SIZE_EFFICIENCY_FILE.read_text())
    assert "DeepBench" in data["source"] and data["approx"] is True
    for precision, kinds in data["curves"].items():
        for kind, points in kinds.items():
            xs, ys = size_curve(precision, kind)
            assert list(xs) == [p[0] for p in points]
            assert all(0 < y <= 1 for y in ys) and ys[-1] == 1
            assert all(a <= b for a, b in zip(ys, ys[1:]))  # monotone in size
            # each value is the running best of the file's points (capped at 1) over the largest
            best = [min(1.0, p[1]) for p in points]
            top = max(best)
            assert ys == pytest.approx([max(best[: i + 1]) / top for i in range(len(best))])
    # the data shows the effect: a 1e7-FLOP GEMM gets under a fifth of a large one's rate
    assert curve_factor(size_curve("fp32", "gemm"), 1e7) < 0.2
    assert curve_factor(size_curve("fp16", "gemm"), 1e13) == 1.0  # held at the ends


def test_interpolation_is_in_log_flops():
    c = monotone_curve([(8.0, 0.2), (10.0, 0.8)])
    assert curve_factor(c, 1e9) == pytest.approx(0.625)  # halfway in log10: (0.25 + 1) / 2
    assert curve_factor(c, 1e6) == pytest.approx(0.25) and curve_factor(c, 1e12) == 1.0
    with pytest.raises(ValueError):
        monotone_curve([])


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_a_small_split_piece_takes_more_than_its_share(v100, dtype):
    small = conv(n=8, c=64, f=64, hw=14)  # 1.2e8 FLOPs forward: the curve's steep part
    whole = op_time(small, v100, dtype=dtype)
    for kw, k in (({"sample_frac": 1 / 4}, 4), ({"filter_frac": 1 / 4}, 4), ({"channel_frac": 1 / 4}, 4)):
        piece = op_time(small, v100, dtype=dtype, **kw)
        assert piece.fwd_s > 1.2 * whole.fwd_s / k, kw
        assert piece.total_s > 1.2 * whole.total_s / k, kw
    big = conv(n=256, c=512, f=512, hw=28)  # 4.6e11 FLOPs: halves stay on the plateau
    assert op_time(big, v100, dtype=dtype, sample_frac=0.5).fwd_s == pytest.approx(
        op_time(big, v100, dtype=dtype).fwd_s / 2, rel=0.01)


def test_thin_pieces_are_slower_than_square_ones_of_the_same_flops(v100):
    # the same FLOPs per device: 4 samples of 4096 features vs 64 samples of 1024 filters
    square = size_factor("linear", v100, "fp32", 2 * 64 * 4096 * 1024, thin=64)
    thin = size_factor("linear", v100, "fp32", 2 * 4 * 4096 * 16384, thin=4)
    assert thin < 0.5 * square
    # data parallelism at 2 samples per GPU: the forward GEMM has M = 2 rows
    fc = linear(256, 4096, 4096)
    assert op_time(fc, v100, sample_frac=2 / 256).fwd_s > 2 * op_time(fc, v100, filter_frac=2 / 256).fwd_s


def _m(s):
    return Measurement(median_s=s, p10_s=s, p90_s=s, repeats=3)


def _record(node, op="conv2d", s=1e-3, **fracs) -> OpRecord:
    key = local_shapes(node, **fracs).key(op)
    return OpRecord(key=key, op=op, fwd=_m(s), bwd_data=_m(2 * s), bwd_weight=_m(3 * s))


def test_localhost_uses_measured_per_shape_records():
    node = conv(n=8, c=16, f=16, hw=8)
    whole, half = _record(node, s=1e-3), _record(node, s=0.8e-3, sample_frac=0.5)
    curve = [(2.0 * n**3, r) for n, r in ((16, 2e9), (64, 2e10), (256, 5e10))]
    cpu = load_cluster("localhost", gpus=2, calibration="/nonexistent/calibration.json").device
    cal = Calibration(cpu_count=2, peak_flops_fp32=5e10, mem_bw_Bps=1e9, matmul_curve=curve,
                      ops={r.key: r for r in (whole, half)})
    t = op_time(node, cpu, sample_frac=0.5, calibration=cal)
    assert (t.source, t.fwd_s) == ("measured", pytest.approx(0.8e-3))  # the piece's own record, not 1/2
    # a quarter of the batch has no record: with two other batches' records, each pass is affine in
    # the batch through them (batch 4: 0.8 ms, batch 8: 1.0 ms -> 0.6 ms fixed + 0.05 ms per sample)
    q = op_time(node, cpu, sample_frac=0.25, calibration=cal)
    assert q.source == "measured-scaled"
    assert (q.fwd_s, q.bwd_data_s, q.bwd_weight_s) == pytest.approx((0.7e-3, 1.4e-3, 2.1e-3))
    assert op_time(node, cpu, sample_frac=0.75, calibration=cal).fwd_s == pytest.approx(0.9e-3)  # between
    # with one other batch's record: scaled from it, at the measured matmul rate of its smaller size
    # (slower than a quarter of the time)
    one = cal.model_copy(update={"ops": {whole.key: whole}})
    q1 = op_time(node, cpu, sample_frac=0.25, calibration=one)
    assert q1.source == "measured-scaled" and q1.fwd_s > 0.25 * 1e-3 * 1.01
    no_curve = one.model_copy(update={"matmul_curve": []})
    assert op_time(node, cpu, sample_frac=0.25, calibration=no_curve).fwd_s == pytest.approx(0.25e-3)
    # two records that fall with the batch (noise): in proportion to the nearer one
    noisy = cal.model_copy(update={"ops": {whole.key: whole, half.key: _record(node, s=1.2e-3, sample_frac=0.5)}})
    assert op_time(node, cpu, sample_frac=0.25, calibration=noisy).fwd_s == pytest.approx(0.6e-3)
    # a shape with no record at any batch: the roofline, with the measured curve's size factor
    fc = linear(4, 32, 32)
    slow = op_time(fc, cpu, calibration=cal)
    flat = op_time(fc, cpu, calibration=no_curve)
    assert slow.source == flat.source == "roofline" and slow.fwd_s > flat.fwd_s


def test_localhost_curve_is_measured_by_profile():
    from hybridpar.profile.ops import matmul_curve

    pts = matmul_curve((16, 128), warmup=1, repeats=3)
    assert [f for f, _ in pts] == [2.0 * 16**3, 2.0 * 128**3] and all(r > 0 for _, r in pts)
    assert math.isfinite(pts[0][1])


def test_profile_measures_every_layout_of_k_ranks():
    """`hybridpar profile --splits 4` measures each op at the local shape of every layout of 4 ranks,
    combined ones (sample=2,channel=2, channel=2,filter=2, ...) too, so those pieces are looked up
    measured rather than scaled."""
    from hybridpar.profile.ops import OpSpec, split_variants

    spec = OpSpec("conv2d", (8, 16, 8, 8), (16, 16, 3, 3), (8, 16, 8, 8), padding=(1, 1))
    keys = {v.key for v in split_variants([spec], (4,))}
    node = spec.node()
    want = {local_shapes(node, 1 / s, 1 / c, 1 / f).key("conv2d")
            for s, c, f in ((1, 1, 1), (4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2))}
    assert keys == want
    depthwise = OpSpec("conv2d", (8, 16, 8, 8), (16, 1, 3, 3), (8, 16, 8, 8), padding=(1, 1), groups=16)
    assert len(split_variants([depthwise], (4,))) == 2  # whole and a quarter of the samples
    lstm = OpSpec("lstm", (8, 12, 16), None, (8, 12, 32))
    assert {v.x for v in split_variants([lstm], (2, 4))} == {(8, 12, 16), (4, 12, 16), (2, 12, 16)}
