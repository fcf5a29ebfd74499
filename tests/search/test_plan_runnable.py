"""The planner never returns a layout its own dry run refuses (issue 33, newcomer item 3): a
CosmoFlow-like 3-D CNN with MaxPool3d (whose backward DTensor cannot shard over channels) is planned
among the layouts that run, the notes say which were excluded and why, and the plan trains."""

from __future__ import annotations

import json

import pytest

import hybridpar
from hybridpar.cli.main import main

MODEL = '''
from torch import nn


def build():
    return nn.Sequential(
        nn.Conv3d(4, 32, 3, padding=1), nn.LeakyReLU(), nn.MaxPool3d(2),
        nn.Conv3d(32, 64, 3, padding=1), nn.LeakyReLU(), nn.MaxPool3d(2),
        nn.Conv3d(64, 128, 3, padding=1), nn.LeakyReLU(), nn.MaxPool3d(2),
        nn.Flatten(), nn.Linear(128 * 4 * 4 * 4, 256), nn.LeakyReLU(), nn.Linear(256, 4))
'''
SHAPE = (4, 32, 32, 32)


@pytest.fixture
def cosmo(tmp_path):
    path = tmp_path / "cosmo.py"
    path.write_text(MODEL)
    return f"{path}:build"


def _layouts(plan) -> set[str]:
    return {lay.to_strategy() for lay in [plan.default_layout, *plan.layers.values()]}


@pytest.mark.parametrize(("cluster", "gpus", "batch", "first"), [("localhost", 2, 2, "channel"),
                                                                   ("lassen", 16, 16, "spatial")])
def test_plan_excludes_layouts_the_dry_run_refuses(cosmo, cluster, gpus, batch, first):
    res = hybridpar.plan(cosmo, cluster, gpus, batch, input_shape=SHAPE)
    excluded = [n for n in res.plan.notes if n.startswith("excluded ")]
    if first == "channel":  # the search's first choice split channels (cheaper at this batch): refused on MaxPool3d
        assert excluded and all("max_pool3d" in n for n in excluded), res.plan.notes
    else:  # 16 GPUs at batch 16: a spatial split of the volume (which runs MaxPool3d) wins outright
        assert not excluded and res.plan.default_layout.spatial > 1, res.plan.notes
    refused = {n.split()[1].rstrip(":") for n in excluded}
    assert not (_layouts(res.plan) & refused)
    assert all(lay.g_size == 1 for lay in [res.plan.default_layout, *res.plan.layers.values()])


@pytest.mark.slow
def test_plan_returned_trains(cosmo, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", cosmo, "--input-shape", ",".join(map(str, SHAPE)), "--gpus", "2",
                 "--batch", "2", "--out", str(out)]) == 0
    assert any(n.startswith("excluded channel=2") for n in json.loads(out.read_text())["notes"])
    capsys.readouterr()
    assert main(["train", "--plan", str(out), "--model", cosmo, "--steps", "2", "--json"]) == 0
    steps = json.loads(capsys.readouterr().out)["steps"]
    assert len(steps) == 2 and all(s["loss"] == s["loss"] for s in steps)  # ran (no NaN)
