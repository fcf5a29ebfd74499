"""A synchronous step of P ranks moves at its slowest rank's pace: `hybridpar profile` measures by how
much (hybridpar.profile.rank_skew) and the localhost cluster stretches compute at P ranks by it; a
process alone (the placer's one-process baseline) is not stretched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridpar.cluster import load_cluster
from hybridpar.cluster.calibration import Calibration, save_calibration
from hybridpar.cluster.localhost import oversubscription, physical_cores
from hybridpar.profile.rank_skew import measure_rank_skew
from hybridpar.search.layers.planner import plan_model
from hybridpar.search.placer.api import place_model


@pytest.mark.timeout(120)
def test_measure_rank_skew_on_this_machine():
    got = measure_rank_skew([1, 2], cycles=1, iters=3)
    assert set(got) == {2} and 1.0 <= got[2] < 10.0  # never below one process alone


def test_the_skew_is_the_median_over_fresh_launches(monkeypatch):
    """One set of workers is one draw of which process is slow: the figure is the median of launches."""
    from hybridpar.profile import rank_skew

    draws = iter([{2: 1.05}, {2: 1.68}, {2: 1.10}, {2: 1.00}, {2: 1.17}])
    monkeypatch.setattr(rank_skew, "_one_launch", lambda ps, cycles, iters, timeout_s: (next(draws), 0.01))
    assert measure_rank_skew([1, 2]) == {2: 1.10}


def test_skew_at_the_nearest_measured_rank_count():
    cal = Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10, rank_skew={2: 1.2, 4: 1.5})
    assert (cal.skew(1), cal.skew(2), cal.skew(3), cal.skew(4), cal.skew(8)) == (1.0, 1.2, 1.2, 1.5, 1.5)
    assert Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10).skew(4) == 1.0


def _save(path, **fields):
    save_calibration(Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10, **fields), path)
    return str(path)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_localhost_compute_stretches_at_p_ranks_not_alone(tmp_path, monkeypatch):
    plain, skewed = _save(tmp_path / "a.json"), _save(tmp_path / "b.json", rank_skew={2: 1.5, 4: 1.25})
    cores = physical_cores()
    for ranks, k in ((1, 1.0), (2, 1.5), (4, 1.25)):
        base = load_cluster("localhost", gpus=ranks, calibration=plain).device.time_share
        assert base == oversubscription(ranks, cores)
        dev = load_cluster("localhost", gpus=ranks, calibration=skewed).device
        assert dev.time_share == pytest.approx(base * k)
    c = load_cluster("localhost", gpus=2, calibration=skewed)
    assert "slowest of 2 ranks" in c.sources["device.time_share"]
    # the planner's compute at 2 ranks stretches by it; the placer's one-process baseline does not
    model = (Net(), (torch.randn(8, 64),))
    pred = {}
    for name, path in (("plain", plain), ("skewed", skewed)):
        monkeypatch.setenv("HYBRIDPAR_CALIBRATION", path)
        pred[name] = plan_model(model, "localhost", 2, 8, strategy="sample=2").prediction.compute_s
        out = place_model(model, "localhost", 2, batch=8, solver="greedy")
        pred[f"{name}_single"], pred[f"{name}_mp"] = out.single_step_s, out.result.breakdown.compute_s
        pred[f"{name}_single_baseline"] = out.baselines["single"]
        pred[f"{name}_single_solver"] = place_model(model, "localhost", 2, batch=8, solver="single").result.step_time_s
    assert pred["skewed"] == pytest.approx(1.5 * pred["plain"])
    assert pred["skewed_single"] == pytest.approx(pred["plain_single"])
    assert pred["skewed_mp"] == pytest.approx(1.5 * pred["plain_mp"])  # the MP step's compute, on 2 ranks
    # everything on device 0 computes alone: the other rank only waits, no core shared, no slower rank
    assert pred["skewed_single_baseline"] == pytest.approx(pred["plain_single_baseline"])
    assert pred["skewed_single_solver"] == pytest.approx(pred["plain_single_baseline"])


def test_a_calibration_with_a_skew_below_one_is_refused(tmp_path):
    import json

    from hybridpar.cluster.calibration import load_calibration
    from hybridpar.errors import UserError

    path = tmp_path / "cal.json"
    data = json.loads(Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10).model_dump_json())
    path.write_text(json.dumps({**data, "rank_skew": {"2": 0.5}}))  # would make 2 ranks compute faster
    with pytest.raises(UserError, match="rank_skew"):
        load_calibration(path)



def _fake_profile(monkeypatch, launch, stage: list, ops=None):
    """run_profile with every measurement but the rank skew's stubbed; `stage` records where it is."""
    from hybridpar.profile import executor, framework_memory, rank_skew, run, runtime_overhead, update
    from hybridpar.profile.gloo import Measurement

    def collectives(world, sizes, kinds, groups, **_kw):
        stage.append("collectives")
        times = [Measurement(median_s=1e-4 + n * 1e-9, p10_s=1e-4, p90_s=2e-4, repeats=1) for n in sizes]
        return {(k, g): times for k in kinds for g in groups}

    model_ops = (lambda *a, **k: (dict(ops), {})) if ops is not None else run._model_ops
    monkeypatch.setattr(rank_skew, "_one_launch", launch)
    monkeypatch.setattr(run, "device_figures",
                        lambda **_kw: stage.append("device") or {"peak_flops_fp32": 1e10, "mem_bw_Bps": 1e9})
    monkeypatch.setattr(run, "_model_ops", lambda *a, **k: stage.append("ops") or model_ops(*a, **k))
    monkeypatch.setattr(run, "measure_collectives", collectives)
    monkeypatch.setattr(framework_memory, "measure_framework_bytes", lambda world: 300 << 20)
    monkeypatch.setattr(executor, "mp_node_overhead_s", lambda: 1e-5)
    fit = {"call_s": 1e-4, "per_tensor_s": 1e-6, "per_element_s": 1e-9}
    monkeypatch.setattr(update, "measure_update",
                        lambda **_kw: stage.append("update") or {"update": {"sgd": fit}, "guard": {"sgd": fit},
                                                                 "loss": fit})
    monkeypatch.setattr(runtime_overhead, "runtime_overhead", lambda: {
        k: (1e-5, 1e-5) for k in ("sample_node_s", "dtensor_node_s", "layer_s", "spatial_op_s")})
    return run.ProfileOptions(ranks=(2,), sizes=(4096, 65536), model=None, splits=(1,), warmup=0, repeats=1)


def test_a_profile_takes_the_skew_at_several_points_and_keeps_the_median(monkeypatch, tmp_path):
    """The machine's speed drifts over tens of seconds: the launches are spread over the profile (after
    its device figures, op table and collectives, and at the end), not taken in a row; one moment's high
    draws do not make the figure."""
    from hybridpar.profile import run

    stage, moments = ["start"], []
    draws = iter([1.25, 1.22, 1.05, 1.06, 1.07, 1.04, 1.08, 1.05])  # a skewed first moment

    def launch(ps, cycles, iters, timeout_s):
        moments.append(stage[-1])
        return {2: next(draws)}, 0.01

    cal, _ = run.run_profile(_fake_profile(monkeypatch, launch, stage), out=tmp_path / "cal.json")
    assert moments == ["device"] * 2 + ["ops"] * 2 + ["collectives"] * 2 + ["update"] * 2
    assert cal.rank_skew == {2: pytest.approx(1.065)}  # not the first moment's 1.25 / 1.22


def test_the_op_table_is_priced_at_a_fresh_process_speed(monkeypatch, tmp_path):
    """The process timing the op table is one draw of this VM's per-process speed: the records it times
    are scaled by a fresh process's speed over its own, both timing the same reference iteration."""
    from hybridpar.cluster.calibration import Measurement, OpRecord, load_calibration
    from hybridpar.profile import rank_skew, run

    m = Measurement(median_s=2e-3, p10_s=1e-3, p90_s=3e-3, repeats=5)
    rec = OpRecord(key="linear|x=8x64|w=64x64|y=8x64", op="linear", fwd=m, bwd_data=m, bwd_weight=m)
    here = iter([0.020, 0.021, 0.019, 0.020])  # this process: slower than the fresh workers' 0.015
    fresh = iter([0.014, 0.015, 0.016, 0.015, 0.015, 0.014, 0.016, 0.015])
    monkeypatch.setattr(rank_skew, "reference_here_s", lambda iters: next(here))
    launch = lambda ps, cycles, iters, timeout_s: ({2: 1.05}, next(fresh))  # noqa: E731
    cal, path = run.run_profile(_fake_profile(monkeypatch, launch, [], ops={rec.key: rec}), out=tmp_path / "c.json")
    assert cal.process_draw is not None and cal.process_draw.scale == pytest.approx(0.015 / 0.020)
    got = load_calibration(path).ops[rec.key]
    assert got.fwd.median_s == pytest.approx(2e-3 * 0.75) and got.bwd_weight.p90_s == pytest.approx(3e-3 * 0.75)
    assert load_calibration(path).process_draw == cal.process_draw
