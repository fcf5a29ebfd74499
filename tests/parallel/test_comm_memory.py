"""Measured communication equals the cost model's, per collective kind, and every collective is timed;
channel=P stores 1/P of the conv weights per rank."""

from __future__ import annotations

import pytest

from hybridpar.train.launch import spawn

from . import _workers

STRATEGIES = ["sample=4", "sample=2,channel=2", "sample=2,filter=2", "channel=2,filter=2", "channel=4"]


@pytest.fixture(scope="module")
def rows():
    return spawn(_workers.comm_and_memory, 4, STRATEGIES)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_measured_bytes_equal_model(rows, strategy):
    mine = [r for r in rows if r["strategy"] == strategy]
    assert len(mine) == 4
    for r in mine:
        assert r["measured"] == r["model"], r
        assert r["measured"], "every layout here communicates"
        # every collective of the step was timed (what `train --json` reports as comm_s)
        assert set(r["seconds"]) == set(r["measured"]) and all(t > 0 for t in r["seconds"].values())


@pytest.mark.slow
def test_channel_parallel_conv_memory_is_one_over_p(rows):
    for r in rows:
        assert r["param_bytes_before"] == r["param_bytes"]  # warm_up gave every shard its final shape
        if r["strategy"] == "channel=4":
            assert 4 * r["param_bytes"]["conv"] == r["serial_conv_bytes"]
        if r["strategy"] == "sample=4":
            assert r["param_bytes"]["conv"] == r["serial_conv_bytes"]
