"""torch.cat along channels inside a model's forward runs distributed (uneven branch widths), equals
serial SGD, and its all-to-all bytes equal the cost model's."""

from __future__ import annotations

import pytest

from hybridpar.runtime.launch import spawn

from . import _workers

STRATEGIES = ["channel=4", "sample=2,channel=2", "channel=2,filter=2"]


@pytest.mark.slow
def test_channel_concat_matches_serial_and_model():
    rows = spawn(_workers.concat_model, 4, STRATEGIES)
    for r in rows:
        if r["rank"] == 0:
            assert r["err"] <= 1e-4, r
        assert r["measured"] == r["model"], r
    assert any(r["measured"].get("alltoall") for r in rows)
