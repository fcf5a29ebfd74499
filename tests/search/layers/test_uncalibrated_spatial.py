"""Issue 35's label on plans whose op times are not this machine's measurements, where the first version
missed them: a spatial plan is priced on one rank's pieces and halo windows (cost.spatial.local_graph),
shapes `hybridpar profile` never times; a model given as an nn.Module; and the advice to profile only
where profiling would measure something (per op-table key, not for another dtype)."""

from __future__ import annotations

import json

import pytest
import torch

import hybridpar
from hybridpar.cli.main import main
from hybridpar.cluster.calibration import Calibration, Measurement, OpRecord, save_calibration
from hybridpar.cost.compute import FREE_OPS, local_shapes
from hybridpar.cost.coverage import LABEL
from hybridpar.cost.spatial import local_graph
from hybridpar.plans import LayerLayout
from hybridpar.search.layers.planner import _scaled, _traced
from hybridpar.search.layers.uncalibrated import profiled_keys

BATCH = 8
_M = Measurement(median_s=1e-5, p10_s=1e-5, p90_s=1e-5, repeats=3)


def _cal(keys: dict[str, str]) -> Calibration:
    """This machine's calibration with a (made-up) measured time at each key (key -> op kind)."""
    ops = {k: OpRecord(key=k, op=op, fwd=_M, bwd_data=_M, bwd_weight=_M) for k, op in keys.items()}
    return Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10, ops=ops)


def _plan_json(capsys, *args) -> dict:
    capsys.readouterr()
    assert main(["plan", "--model", "small_cnn", "--gpus", "2", "--batch", str(BATCH), "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.timeout(60)
def test_spatial_plan_is_labelled_on_its_pieces(tmp_path, monkeypatch, capsys):
    path = tmp_path / "cal.json"
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(path))
    graph = _scaled(_traced("small_cnn", None)[0], BATCH)
    # every key `hybridpar profile --model small_cnn --batch 8 --splits 2` measures
    whole = profiled_keys(graph, 2)
    assert len(whole) > len(graph.nodes)  # whole and at each layout of 2 ranks
    save_calibration(_cal(whole), path)
    assert _plan_json(capsys, "--strategy", "sample=2")["uncalibrated_estimate"] is None
    got = _plan_json(capsys, "--strategy", "height=2")
    note = got["uncalibrated_estimate"]
    assert note is not None and note.startswith(LABEL) and got["plan"]["notes"][0] == note
    # the pieces' times come from the whole layers' records (cost.compute._piece_hit); the halo windows'
    # copies (pointwise) have none
    assert "pointwise x" in note and "conv2d" not in note
    assert "(*: not timed by `hybridpar profile`: a spatial piece" in note
    # the profile cannot measure those shapes: it is not advised
    assert "to measure them" not in note

    # measured at the pieces' own shapes (as the spatial pricing looks them up): no label
    pieces = local_graph(graph, LayerLayout(height=2))
    local = {local_shapes(n, 1 / 2).key(n.op): n.op for n in pieces.nodes if n.op not in FREE_OPS}
    assert set(local) - set(whole)  # halo windows and pieces: keys the whole graph does not have
    save_calibration(_cal({**whole, **local}), path)
    assert _plan_json(capsys, "--strategy", "height=2")["uncalibrated_estimate"] is None


def test_spatial_plans_profile_advice_names_the_sample_split_too():
    """sample=2 x height=2 on 4 ranks: the head runs on B/2 samples, a layout of 2 ranks, not of 4."""
    from hybridpar.plans import Plan
    from hybridpar.search.layers.uncalibrated import profile_splits

    plan = Plan(model="m", world_size=4, batch=8, dp=4, default_layout=LayerLayout(sample=2, height=2))
    assert profile_splits(plan) == (2, 4)
    assert profile_splits(plan.model_copy(update={"default_layout": LayerLayout(sample=4)})) == (4,)


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.fc = torch.nn.Linear(4 * 8 * 8, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


@pytest.mark.timeout(60)
def test_module_plan_is_labelled(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(tmp_path / "none.json"))
    res = hybridpar.plan(_Tiny(), "localhost", 2, BATCH, example_inputs=(torch.randn(BATCH, 3, 8, 8),),
                         strategy="sample=2")
    note = res.plan.notes[0]
    assert note.startswith(f"{LABEL}: no calibration file"), res.plan.notes
    assert "hybridpar profile --model path/to/file.py:factory" in note


def test_profile_advice_is_per_key_and_never_for_another_dtype(tmp_path, monkeypatch):
    from hybridpar.cluster import load_cluster
    from hybridpar.cost.coverage import coverage

    dev = load_cluster("localhost", gpus=2).device
    graph = _scaled(_traced("small_cnn", None)[0], BATCH)
    convs = [n for n in graph.nodes if n.op == "conv2d"]
    assert len({local_shapes(n).key(n.op) for n in convs}) >= 2
    rest = {local_shapes(n).key(n.op): n.op for n in graph.nodes if n.op not in FREE_OPS and n.op != "conv2d"}
    cal = _cal(rest)
    untimed = {local_shapes(convs[0]).key("conv2d"): "a made-up reason"}
    half = cal.model_copy(update={"untimed": untimed})
    cov = coverage(graph, dev, lambda n: (1.0, 1.0, 1.0), calibration=half)
    # one conv key the profile could not time, the others simply not measured: profiling helps
    assert "could not be timed: a made-up reason" in cov.note("ARGS") and "profile ARGS" in cov.note("ARGS")
    every = cal.model_copy(update={"untimed": {local_shapes(n).key("conv2d"): "why" for n in convs}})
    assert "profile ARGS" not in coverage(graph, dev, lambda n: (1.0, 1.0, 1.0), calibration=every).note("ARGS")
    # fp16: the profile times no fp16 op, so it advises nothing; bf16: `profile --precision bf16` times
    # them (the plan's ARGS carry the option: tests/profile/test_channels_last_pricing.py)
    fp16 = coverage(graph, dev, lambda n: (1.0, 1.0, 1.0), dtype="fp16", calibration=cal).note("ARGS")
    assert fp16.startswith(LABEL) and "fp32" in fp16 and "hybridpar profile" not in fp16
    bf16 = coverage(graph, dev, lambda n: (1.0, 1.0, 1.0), dtype="bf16", calibration=cal).note("ARGS")
    assert bf16.startswith(LABEL) and "none timed under bf16 autocast" in bf16 and "profile ARGS" in bf16
