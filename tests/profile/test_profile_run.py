"""`hybridpar profile` on this machine, end to end, and the calibrated model against a fresh run."""

import json

import pytest

from hybridpar.cli.main import main
from hybridpar.cluster import load_cluster
from hybridpar.cluster.calibration import load_calibration
from hybridpar.cost.collectives import allreduce_time

SIZES = "16K,256K,2M"
FRESH_BYTES = 512 << 10  # between the calibrated sizes: a prediction, not a fitted point


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    path = tmp_path_factory.mktemp("cal") / "calibration.json"
    argv = ["profile", "--out", str(path), "--ranks", "2", "--model", "small_cnn", "--batch", "4",
            "--sizes", SIZES, "--repeats", "7", "--warmup", "2", "--json"]
    return path, main(argv)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_profile_writes_a_calibration_that_localhost_uses(calibration, capsys):
    path, rc = calibration
    assert rc == 0 and path.exists()
    cal = load_calibration(path)
    assert set(cal.gloo) == {2} and cal.gloo[2].sizes_bytes == [16 << 10, 256 << 10, 2 << 20]
    assert cal.peak_flops_fp32 > 1e8 and cal.mem_bw_Bps > 1e7
    assert cal.ops and all(r.fwd.median_s > 0 for r in cal.ops.values())
    assert all(r.bwd_weight is not None for r in cal.ops.values() if r.op in ("conv2d", "linear"))
    assert {r.op for r in cal.ops.values()} == {"conv2d", "linear", "batchnorm", "batchnorm_global", "relu",
                                               "maxpool", "adaptive_avgpool"}
    assert {(f.kind, f.world_size, f.group_size) for f in cal.collectives} == {
        (k, 2, 2) for k in ("allreduce", "allgather", "reduce_scatter", "alltoall", "p2p", "p2p_post")}
    assert cal.mp_node_overhead_s is not None and cal.mp_node_overhead_s > 0
    assert cal.runtime_overhead is not None and cal.runtime_overhead.layer_fwd_s + cal.runtime_overhead.layer_bwd_s > 0
    c = load_cluster("localhost", gpus=2, calibration=path)
    assert c.device.peak("fp32") == cal.peak_flops_fp32
    # the memory model's framework constant: an initialised gloo rank holding no model (torch's libraries
    # alone are over 100 MiB resident), and what the memory model then adds
    from hybridpar.cost.memory import framework_bytes_for

    assert 100 << 20 < cal.framework_bytes < 2 << 30 and framework_bytes_for(None, path) == cal.framework_bytes
    # the optimizer step and the loss, fitted for every optimizer kind (hybridpar.profile.update)
    assert set(cal.update) == {"sgd", "momentum", "adamw"} and cal.loss is not None
    assert c.intra.link_latency_s == pytest.approx(cal.gloo[2].alpha_s)
    assert {m.kind for m in c.measured_collectives} == {f.kind for f in cal.collectives}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_small_cnn_ops_use_the_measured_table(calibration):
    import hybridpar.graph.tracing as trace_mod
    from hybridpar.cost.compute import op_time
    from hybridpar.graph.models import load_model

    path, rc = calibration
    assert rc == 0
    m = load_model("small_cnn", batch=4)
    g = trace_mod.trace(m.module, m.example_inputs)
    dev = load_cluster("localhost", gpus=2, calibration=path).device
    ops = [n for n in g.nodes if n.op in ("conv2d", "linear", "batchnorm", "relu", "maxpool")]
    assert len({n.op for n in ops}) == 5
    assert all(op_time(n, dev, calibration=path).source == "measured" for n in ops)
    # batch norm over split samples is priced as the runtime runs it: the "batchnorm_global" record
    from hybridpar.cost.compute import local_shapes

    bn = next(n for n in ops if n.op == "batchnorm")
    rec = load_calibration(path).ops[local_shapes(bn).key("batchnorm_global")]
    t = op_time(bn, dev, calibration=path, variant="batchnorm_global")
    assert t.fwd_s == pytest.approx(rec.fwd.median_s * dev.time_share)
    assert t.bwd_data_s == pytest.approx(rec.bwd_data.median_s * dev.time_share)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fresh_collectives_of_every_kind_match_the_calibrated_prediction(calibration):
    """Each kind the runtime issues (allreduce, allgather, reduce-scatter, all-to-all), priced by the
    cost model on the calibrated localhost, against a fresh measurement in new processes (every kind
    in one world; a kind outside its tolerance is measured again, up to three times in all). Gloo's
    kinds differ by more than the tolerance (at 2 ranks, 512 KiB: all-to-all ~0.8 ms, allreduce
    ~2 ms), so pricing them all with one fit would miss.

    Tolerance, from measured spread. The allreduce prediction is T = 2 alpha + n beta at p = 2 from the
    fit. On this shared 2-core machine (load average up to 14 while other jobs ran) six
    calibrate-then-measure trials gave fresh/predicted allreduce ratios 0.75, 0.76, 0.76, 2.9, 4.3 and
    5.0, while the runs' own (p90 - p10)/median spreads were 0.2 to 18: the error is the machine's load
    changing between runs, and it is as large as the spread the runs themselves show. So a ratio is
    accepted within a factor (1 + s)(1 + r), s = the largest spread measured in the calibration or the
    fresh run, r = the fit's worst relative residual, but at least a factor 1.5. On a quiet machine
    (spreads ~0.2-0.5) that is a factor ~1.5-2, which a model wrong in form or scale (say a beta off by
    the ring factor, or 10x) misses."""
    from hybridpar.cost.collectives import alltoall_time, concurrent_collective_time
    from hybridpar.profile.gloo import measure_collectives

    path, rc = calibration
    assert rc == 0
    cal = load_calibration(path)
    cl = load_cluster("localhost", gpus=2, calibration=path)
    fits = {f.kind: f for f in cal.collectives if f.group_size == 2}
    fits["allreduce"] = cal.gloo[2]
    predicted = {"allreduce": allreduce_time(FRESH_BYTES, [0, 1], cl)}
    predicted |= {k: concurrent_collective_time(k, FRESH_BYTES, [[0, 1]], cl) for k in ("allgather", "reduce_scatter")}
    predicted["alltoall"] = alltoall_time(2 * FRESH_BYTES, [0, 1], cl)  # buffer; half goes to the peer
    for k in predicted:
        assert predicted[k] == pytest.approx(fits[k].predict_s(FRESH_BYTES), rel=1e-3), k
    tries: dict[str, list] = {k: [] for k in predicted}
    left = list(predicted)
    for _ in range(3):
        fresh = measure_collectives(2, [FRESH_BYTES], left, (2,), warmup=2, repeats=10)
        for k in list(left):
            m = fresh[(k, 2)][0]
            spread = max(t.rel_spread for t in fits[k].times)
            tol = max(1.5, (1 + max(spread, m.rel_spread)) * (1 + fits[k].max_rel_residual))
            ratio = m.median_s / predicted[k]
            tries[k].append((round(ratio, 3), round(tol, 2)))
            if 1 / tol <= ratio <= tol:
                left.remove(k)
        if not left:
            break
    assert not left, f"fresh/predicted outside tolerance in every try: {json.dumps({k: tries[k] for k in left})}"
