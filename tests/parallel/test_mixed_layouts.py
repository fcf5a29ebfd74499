"""Per-layer layouts with different sample/channel grids: convolutions redistribute in and out, the
result equals serial SGD, and the measured alltoall bytes equal the cost model's."""

from __future__ import annotations

import pytest

from hybridpar.train.launch import spawn

from . import _workers


@pytest.mark.slow
def test_mixed_per_layer_layouts_match_serial_and_model():
    layers = {"conv1": "sample=4", "layers.0.conv1": "channel=4", "layers.0.conv2": "channel=2,filter=2",
              "layers.1.conv1": "sample=4", "layers.1.downsample.0": "filter=4", "layers.2.conv2": "sample=4"}
    rows = spawn(_workers.mixed_plan, 4, layers, "sample=2,channel=2")
    assert rows[0]["err"] <= 1e-4, rows[0]
    for r in rows:
        assert r["measured"] == r["model"], r
        assert r["measured"]["alltoall"] > 0
