"""Spatial x channel/filter priced by the planner (search.layers.spatial_plan, issue 30): `hybridpar
plan --strategy height=2,channel=2 --json` (and filter) predicts per kind exactly the bytes the
runtime sends in a training step (halo exchanges, the channel/filter collectives on the spatial
window, batch-norm statistics, gradient sums over the sample x spatial ranks, the output's gathers,
DTensor's moves around layers it runs whole), on rank 0, whose pieces are the largest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridpar.cli.main import main
from hybridpar.train.launch import spawn

from ._spatial_plan_bytes_workers import BATCH, SHAPES, step_bytes

WORKERS = Path(__file__).with_name("_spatial_plan_bytes_workers.py")
CASES = [("tiny_net", "height=2,channel=2"), ("dilated", "height=2,filter=2")]


def _predicted(capsys, factory: str, strategy: str) -> dict[str, int]:
    shape = ",".join(map(str, SHAPES[factory]))
    code = main(["plan", "--model", f"{WORKERS}:{factory}", "--input-shape", shape, "--batch", str(BATCH),
                 "--gpus", "4", "--cluster", "localhost", "--strategy", strategy, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    res = json.loads(out.out)
    assert res["plan"]["default_layout"]["height"] == 2 and res["plan"]["default_layout"]["channel"] * \
        res["plan"]["default_layout"]["filter"] == 2
    return res["predicted"]["comm_bytes"]


@pytest.mark.slow
def test_plan_predicts_the_bytes_spatial_channel_filter_sends(capsys):
    sent = spawn(step_bytes, 4, CASES)
    for (factory, strategy), ranks in zip(CASES, sent):
        predicted = _predicted(capsys, factory, strategy)
        assert predicted == ranks[0], (factory, strategy, predicted, ranks[0])
        assert predicted["halo"] > 0 and predicted["allgather"] > 0
