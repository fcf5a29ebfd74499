"""torch.cat along channels inside a model's forward runs distributed (uneven branch widths), equals
serial SGD, and its bytes equal the cost model's: the analytic model of our layers plus, where
DTensor redistributes between them (channel pieces that would be empty are gathered), what the dry
run recorded before any rank started."""

from __future__ import annotations

import pytest
import torch

from hybridpar.parallel.check import dry_run
from hybridpar.train.launch import spawn

from . import _workers

STRATEGIES = ["channel=4", "sample=2,channel=2", "channel=2,filter=2"]


@pytest.mark.slow
def test_channel_concat_matches_serial_and_model():
    torch.manual_seed(0)
    dry = {s: dry_run(_workers.CatNet(), s, torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)), world_size=4)
           for s in STRATEGIES}
    rows = spawn(_workers.concat_model, 4, STRATEGIES)
    for r in rows:
        d = dry[r["strategy"]]
        if r["rank"] == 0:
            assert r["err"] <= 1e-4, r
            assert r["measured"] == d.total_bytes, (r["strategy"], r["measured"], d.total_bytes)
        if not d.dtensor_bytes:  # our layers only: the analytic model holds on every rank
            assert r["measured"] == r["model"], (r["strategy"], r["rank"], r["measured"], r["model"])
    assert any(r["measured"].get("alltoall") for r in rows)
    assert dry["channel=4"].dtensor_bytes  # 5 and 3 channels over 4 ranks: gathered, and logged
