"""The spatial search offers what the runtime runs, and prices it as it runs.

- A split whose pieces run out in later layers (a 32^3 CosmoFlow's last pooling to 1^3 under depth=2;
  a 2-D CNN pooled to 1 x 1 under height=2) runs (empty pieces), so the search offers it: it used to
  drop any split larger than the smallest pooled size ("no uniform sample x spatial layout of 2 ranks
  fits"), although `--strategy depth=2` trained.
- A bilinear nn.Upsample runs on the gathered input (SpatialGathered): `plan --strategy height=2`
  predicts the bytes a training step sends, the forward gather of its input and the backward gather of
  its output's gradient included (the graph records the interpolation mode); F.interpolate, which
  DTensor runs on the gathered input, is priced alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridpar.cli.main import main
from hybridpar.graph import trace
from hybridpar.search.graph_cache import traced_graph
from hybridpar.search.layers.spatial_plan import spatial_layouts
from hybridpar.train.launch import spawn

from ._spatial_candidates_workers import BATCH, SHAPES, gap_1x1, train_cases

WORKERS = Path(__file__).with_name("_spatial_candidates_workers.py")


def _offered(graph, gpus: int, batch: int) -> set[str]:
    return {lay.to_strategy() for lay in spatial_layouts(graph, gpus, batch)}


@pytest.mark.timeout(60)
def test_search_offers_splits_whose_pieces_run_out():
    cosmo = traced_graph("cosmoflow", (4, 32, 32, 32))[0]  # 32 -> ... -> 1 after five MaxPool3d(2)
    assert {"depth=2", "height=2", "width=2"} <= _offered(cosmo, 2, 8)
    cnn = trace(gap_1x1(), torch.randn(8, *SHAPES["gap_1x1"]), train=True)  # 4 x 4 -> 1 x 1, global pool
    assert {"height=2", "width=2"} <= _offered(cnn, 2, 8)
    # no dim cut into more pieces than it has rows anywhere (4): ranks with nothing in every layer
    eight = _offered(cnn, 8, 8)
    assert "height=2,width=4" in eight and "height=8" not in eight and "width=8" not in eight


@pytest.mark.timeout(120)
def test_plan_compares_depth_2_for_cosmoflow_at_32(capsys):
    capsys.readouterr()
    assert main(["plan", "--model", "cosmoflow", "--input-shape", "4,32,32,32", "--cluster", "localhost",
                 "--gpus", "2", "--batch", "8", "--json"]) == 0
    spatial = json.loads(capsys.readouterr().out)["spatial"]
    assert spatial["reason"] != "not considered", spatial
    assert spatial["best_spatial"]["layout"] in ("depth=2", "height=2", "width=2")


def _predicted(capsys, factory: str, strategy: str) -> dict[str, int]:
    shape = ",".join(map(str, SHAPES[factory]))
    capsys.readouterr()
    code = main(["plan", "--model", f"{WORKERS}:{factory}", "--input-shape", shape, "--batch", str(BATCH),
                 "--gpus", "2", "--cluster", "localhost", "--strategy", strategy, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)["predicted"]["comm_bytes"]


@pytest.mark.timeout(120)
def test_runtime_runs_them_and_plan_bytes_are_sent_bytes(capsys):
    cases = [("gap_1x1", "height=2"), ("bilinear_unet", "height=2")]
    ranks = spawn(train_cases, 2, cases)
    for case, got in zip(cases, ranks):
        assert max(r["weights"] for r in got) <= 1e-5, (case, got)  # as one process
    predicted = _predicted(capsys, "bilinear_unet", "height=2")
    assert predicted == ranks[1][0]["bytes"], (predicted, ranks[1][0]["bytes"])
    # the upsampling's two gathers beside the output's: [4, 4, 2, 3] in, [4, 4, 4, 6] its gradient, x 2 ranks
    assert predicted["allgather"] == (4 * 3 * 4 * 6 + 4 * 4 * 2 * 3 + 4 * 4 * 4 * 6) * 4 * 2
    # F.interpolate runs through DTensor, which gathers the same (not compared with the log: DTensor's
    # moves inside its op dispatch do not reach parallel.dtensor.log's dispatch mode)
    assert _predicted(capsys, "functional_unet", "height=2") == predicted
