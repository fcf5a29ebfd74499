"""`hybridpar profile --model M --splits k` times each op at the shape the runtime runs it, and the plan's
uncalibrated check looks it up there: a depthwise (grouped) conv runs whole over channels under a
channel/filter layout (cost.layout_comm.splits_by_layout), on its sample group's B/s samples. The
profile used to try it cut to 1/c of its channels (which cannot run: listed untimed), and a plan then
said "UNCALIBRATED ESTIMATE: ... conv2d" for a conv whose whole shape was timed (ConvNeXt V2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from hybridpar.cli.main import main
from hybridpar.cluster.calibration import Calibration, save_calibration
from hybridpar.cost.compute import local_shapes
from hybridpar.graph import trace
from hybridpar.profile.run import ProfileOptions, _model_ops, graph_work, op_specs

MODEL = f"{Path(__file__)}:depthwise"
SHAPE = (3, 8, 8)
BATCH = 4


def depthwise() -> nn.Module:
    """A ConvNeXt-like block: a split conv, a depthwise 7x7 conv (runs whole), a pointwise conv, a head."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 7, padding=3, groups=8), nn.ReLU(),
                         nn.Conv2d(8, 8, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))


def _note(capsys, strategy: str) -> str | None:
    capsys.readouterr()
    assert main(["plan", "--model", MODEL, "--input-shape", ",".join(map(str, SHAPE)), "--gpus", "4",
                 "--batch", str(BATCH), "--cluster", "localhost", "--strategy", strategy, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["uncalibrated_estimate"]


@pytest.mark.timeout(120)
def test_depthwise_conv_profiled_and_looked_up_whole_over_channels(tmp_path, monkeypatch, capsys):
    torch.set_num_threads(1)
    path = tmp_path / "cal.json"
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(path))
    opts = ProfileOptions(model=MODEL, batch=BATCH, input_shape=SHAPE, splits=(4,), warmup=1, repeats=2)
    specs = op_specs(opts)
    records, untimed = _model_ops(opts, specs, graph_work(opts, {s.key for s in specs}), lambda _: None)
    assert not untimed, untimed  # nothing tried at a shape the runtime never runs
    graph = trace(depthwise(), torch.randn(BATCH, *SHAPE), train=True)
    dw = next(n for n in graph.nodes if n.attr("groups") == 8)
    for s in (1, 2, 4):  # whole over channels at each sample degree of a layout of 4 ranks (sample=2,channel=2)
        assert local_shapes(dw, 1 / s).key("conv2d") in records, s
    assert local_shapes(dw, 1.0, 0.5).key("conv2d") not in records

    save_calibration(Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10, ops=records), path)
    for strategy in ("channel=4", "sample=2,channel=2", "sample=2,filter=2"):
        note = _note(capsys, strategy)
        assert note is None or "conv2d" not in note, (strategy, note)
