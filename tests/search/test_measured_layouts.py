"""A model's own step under a sample or channel/filter layout, timed by `hybridpar profile --model` on a fake world
(hybridpar.profile.layout_steps), prices that layout's compute in the planner (search.layers.measured):
the uniform layout's priced forward and backward equal the measurement x the time share, the search
compares layouts with it, and the plan says so. The measurement itself: rank 0's step with the time in
its collectives and redistributions taken out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hybridpar.cluster.calibration import Calibration, LayoutStep, save_calibration

MODEL = f"{Path(__file__).resolve()}:tiny_cnn"


def tiny_cnn():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    return net, (torch.randn(4, 3, 8, 8),)


def pooled_cnn():
    """Most of its work before its first layer (as CosmoFlow's stem): a pooling and a ReLU at full size."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.AvgPool2d(2), nn.ReLU(), nn.Conv2d(3, 4, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(4, 4))
    return net, (torch.randn(4, 3, 64, 64),)


def _plan(tmp_path, monkeypatch, steps, strategy=None, name="cal", model=MODEL, **options):
    from hybridpar.api import plan

    path = tmp_path / f"{name}.json"
    save_calibration(Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10, layout_steps=steps), path)
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(path))
    return plan(model, "localhost", 2, 4, dry_run=True, **({"strategy": strategy} if strategy else {}), **options)


def _step(layout, rest_s, batch=4, input_shape=(3, 8, 8)):
    """As `hybridpar profile` files it: under the shape the model ran at (tiny_cnn's own)."""
    return LayoutStep(model=MODEL, batch=batch, input_shape=list(input_shape) if input_shape else None, world_size=2,
                      layout=layout, step_s=rest_s, collectives_s=0.0, redistributions_s=0.0, rest_s=rest_s)


def _graph_compute(res) -> float:
    return sum(v["fwd_s"] + v["bwd_s"] for v in res.prediction.per_layer.values())


def test_the_measured_step_prices_its_layout(tmp_path, monkeypatch):
    from hybridpar.cluster import load_cluster

    share = load_cluster("localhost", gpus=2).device.time_share
    bare = _plan(tmp_path, monkeypatch, [], "channel=2", "bare")
    assert not any("fake world" in n for n in bare.plan.notes)
    want = 3 * _graph_compute(bare) / share  # three times what the op table prices: not a no-op
    measured = _plan(tmp_path, monkeypatch, [_step("channel=2", want)], "channel=2")
    assert _graph_compute(measured) == pytest.approx(want * share, rel=1e-6)
    grown = _graph_compute(measured) - _graph_compute(bare)
    assert measured.prediction.step_time_s - bare.prediction.step_time_s == pytest.approx(grown, rel=1e-6)
    assert any("channel=2 x3.00" in n and "fake world" in n for n in measured.plan.notes)
    # another batch, or a sample-only plan: untouched
    other = _plan(tmp_path, monkeypatch, [_step("channel=2", want, batch=8)], "channel=2", "other")
    assert other.prediction.step_time_s == pytest.approx(bare.prediction.step_time_s, rel=1e-9)
    dp = _plan(tmp_path, monkeypatch, [_step("channel=2", want)], "sample=2", "dp")
    assert not any("fake world" in n for n in dp.plan.notes)


def test_a_measured_sample_step_prices_the_sample_layout_alone(tmp_path, monkeypatch):
    """Under sample=2 the op table times each op alone; the model's own step prices it where measured.
    Spatial layouts (their own cost contexts) and channel/filter layouts keep their pricing."""
    from hybridpar.cluster import load_cluster

    share = load_cluster("localhost", gpus=2).device.time_share
    bare = _plan(tmp_path, monkeypatch, [], "sample=2", "bare")
    bare_c = _plan(tmp_path, monkeypatch, [], "channel=2", "bare_c")
    bare_h = _plan(tmp_path, monkeypatch, [], "height=2", "bare_h")
    want = 0.5 * _graph_compute(bare) / share
    steps = [_step("sample=2", want)]
    measured = _plan(tmp_path, monkeypatch, steps, "sample=2")
    assert _graph_compute(measured) == pytest.approx(want * share, rel=1e-6)
    assert measured.prediction.step_time_s < bare.prediction.step_time_s
    assert any("sample=2 x0.50" in n and "fake world" in n for n in measured.plan.notes)
    chan = _plan(tmp_path, monkeypatch, steps, "channel=2", "chan")
    assert chan.prediction.step_time_s == pytest.approx(bare_c.prediction.step_time_s, rel=1e-9)
    assert not any("fake world" in n for n in chan.plan.notes)
    height = _plan(tmp_path, monkeypatch, steps, "height=2", "height")
    assert height.prediction.step_time_s == pytest.approx(bare_h.prediction.step_time_s, rel=1e-9)
    # the plan file (which holds the model's traced shape) is priced as the plan was
    from hybridpar.search.layers.planner import evaluate_plan

    again = evaluate_plan(measured.plan, calibration=str(tmp_path / "cal.json"))
    assert again.step_time_s == pytest.approx(measured.prediction.step_time_s, rel=1e-6)
    # a file from before 2026-12-05 held the model's own shape as None: still found for a plan given none
    legacy = _plan(tmp_path, monkeypatch, [_step("sample=2", want, input_shape=None)], "sample=2", "legacy")
    assert legacy.prediction.step_time_s == pytest.approx(measured.prediction.step_time_s, rel=1e-6)


def test_the_nodes_before_the_first_layer_are_scaled_with_the_layers(tmp_path, monkeypatch):
    """The measurement is of the whole graph: where most of the priced work comes before the first
    layer, a measured step under the priced sum still prices the graph at the measurement (the factor
    taken over the layers alone would fall below its bound, and the plan would keep the old price)."""
    from hybridpar.cluster import load_cluster
    from hybridpar.search.layers.planner import PlannerConfig, _setup

    model = f"{Path(__file__).resolve()}:pooled_cnn"
    share = load_cluster("localhost", gpus=2).device.time_share
    bare = _plan(tmp_path, monkeypatch, [], "sample=2", "bare", model=model)
    setup = _setup(model, "localhost", 2, 4, PlannerConfig(calibration=str(tmp_path / "bare.json")))
    prefix = {n.module for n in setup.lg.prefix}
    before = sum(v["fwd_s"] + v["bwd_s"] for k, v in bare.prediction.per_layer.items() if k in prefix)
    assert before > 0.3 * _graph_compute(bare)  # the case in point: (0.3 - 0.3) / 0.7 is under the bound
    want = 0.3 * _graph_compute(bare) / share
    step = LayoutStep(model=model, batch=4, input_shape=[3, 64, 64], world_size=2, layout="sample=2", step_s=want,
                      collectives_s=0.0, redistributions_s=0.0, rest_s=want)
    measured = _plan(tmp_path, monkeypatch, [step], "sample=2", model=model)
    assert _graph_compute(measured) == pytest.approx(want * share, rel=1e-6)
    assert any("sample=2 x0.30" in n for n in measured.plan.notes)


def test_the_search_compares_layouts_with_the_measurement(tmp_path, monkeypatch):
    """Left to choose between channel=2 and filter=2 per layer, the search takes the one measured
    faster, whichever it is; a layout not measured takes the mean of the same-size layouts measured."""
    base = _graph_compute(_plan(tmp_path, monkeypatch, [], "channel=2", "bare"))
    picks = []
    for fast, slow in (("channel=2", "filter=2"), ("filter=2", "channel=2")):
        steps = [_step(fast, base / 10), _step(slow, 10 * base)]
        res = _plan(tmp_path, monkeypatch, steps, None, f"{fast}", exclude_layouts=("sample=2",))
        lays = {lay.to_strategy() for lay in (res.plan.default_layout, *res.plan.layers.values())}
        picks.append(lays)
        assert lays == {fast}
    assert picks[0] != picks[1]
    slow_only = _plan(tmp_path, monkeypatch, [_step("channel=2", 4 * base)], "filter=2", "slow")
    unmeasured = _plan(tmp_path, monkeypatch, [], "filter=2", "fil")
    assert _graph_compute(slow_only) > 2 * _graph_compute(unmeasured)  # filter=2 took channel=2's factor


def test_the_fake_world_step_leaves_out_collectives_and_redistributions():
    from hybridpar.profile.layout_steps import layout_steps

    got = layout_steps(MODEL, 4, None, (2,), repeats=3)
    by = {s["layout"]: s for s in got["steps"]}
    assert set(by) == {"sample=2", "channel=2", "filter=2"}
    for lay, s in by.items():
        assert s["world_size"] == 2
        assert s["redistributions_s"] == 0 or lay != "sample=2"  # no DTensors under a sample split
        if lay != "sample=2":  # each split layer's exchanges ran (as no-ops) and were timed
            assert 0 < s["collectives_s"] < s["step_s"]
        assert 0 < s["rest_s"] < s["step_s"]
        assert s["rest_s"] == pytest.approx(s["step_s"] - s["collectives_s"] - s["redistributions_s"], rel=0.5)



def test_a_layout_the_runtime_cannot_run_is_left_out_with_why():
    """The zoo's CosmoFlow-like 3-D CNN: its 3-D pooling's backward has no DTensor rule under a channel
    split; the profile goes on without those layouts (no plan uses them: the dry run refuses them) and
    says why."""
    from hybridpar.profile.layout_steps import layout_steps

    spec = f"{Path(__file__).resolve().parents[2]}/benchmarks/_holdout_models.py:cosmoflow_32"
    got = layout_steps(spec, 2, None, (2,), repeats=1)
    assert [s["layout"] for s in got["steps"]] == ["sample=2"]
    assert set(got["skipped"]) == {"channel=2", "filter=2"}
    assert all("pool3d" in why for why in got["skipped"].values())
