"""The per-layer planner prices recurrent layers as the MP placer does: each LSTM whole on every rank
of a sample group, for the rank's samples, at `hybridpar.cost.compute.op_time` (the record `hybridpar
profile` measured at that shape first). Before, the nodes before the first conv/linear (an embedding
and the LSTMs over it) were priced at nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from hybridpar.cluster import load_cluster
from hybridpar.cluster.calibration import Calibration, Measurement, OpRecord, op_key, save_calibration
from hybridpar.cost.compute import op_time
from hybridpar.search.layers.planner import plan_model

BATCH, STEPS, EMBED, HIDDEN = 8, 10, 8, 12


class Towers(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, EMBED)
        self.a = nn.LSTM(EMBED, HIDDEN, batch_first=True)
        self.b = nn.LSTM(EMBED, HIDDEN, batch_first=True)
        self.fc = nn.Linear(2 * HIDDEN, 4)

    def forward(self, tokens):
        e = self.embed(tokens)
        return self.fc(torch.cat([self.a(e)[0][:, -1], self.b(e)[0][:, -1]], 1))


def _model():
    torch.manual_seed(0)
    return Towers(), (torch.randint(0, 16, (BATCH, STEPS)),)


def _m(s: float) -> Measurement:
    return Measurement(median_s=s, p10_s=s, p90_s=s, repeats=3)


@pytest.fixture
def lstm_profiled(tmp_path, monkeypatch):
    """A calibration holding the LSTM's record at a sample group's shape (half the batch), as
    `hybridpar profile` writes it (no weight key: an LSTM's weights are weight_ih/_hh)."""
    n = BATCH // 2
    key = op_key("lstm", (n, STEPS, EMBED), None, (n, STEPS, HIDDEN))
    cal = Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10,
                      ops={key: OpRecord(key=key, op="lstm", fwd=_m(3e-3), bwd_data=_m(7e-3))})
    path = tmp_path / "cal.json"
    save_calibration(cal, path)
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(path))
    return cal


def _lstm_nodes():
    from hybridpar.search.layers.planner import _traced

    graph, _, _ = _traced(_model(), None)
    return [n for n in graph.nodes if n.op == "lstm"]


def test_lstm_priced_from_its_profile_record_as_the_placer_does(lstm_profiled):
    res = plan_model(_model(), "localhost", 2, BATCH, strategy="sample=2")
    per_layer = res.prediction.per_layer
    cluster = load_cluster("localhost", gpus=2)
    k = cluster.device.time_share
    for name in ("a", "b"):  # each tower: the measured record (whole LSTM, half the batch)
        assert per_layer[name]["fwd_s"] == pytest.approx(3e-3 * k)
        assert per_layer[name]["bwd_s"] == pytest.approx(7e-3 * k)
    # the placer's rule on the same node at the rank's shape gives the same figures
    for node in _lstm_nodes():
        n = BATCH // 2
        scaled = dataclasses.replace(node, in_shapes=((n, STEPS, EMBED),), out_shape=(n, STEPS, HIDDEN))
        t = op_time(scaled, cluster)
        assert t.source == "measured"
        assert (t.fwd_s, t.bwd_s) == pytest.approx((per_layer[node.module]["fwd_s"], per_layer[node.module]["bwd_s"]))
    # both towers and the embedding are in the step's compute, forward and backward, with the
    # optimizer step and the loss (tests/search/test_step_extras.py; a roofline here: no fits measured)
    layers = sum(v["fwd_s"] + v["bwd_s"] for v in per_layer.values())
    assert 0 < res.prediction.compute_s - layers < 1e-4
    assert res.prediction.compute_s >= 2 * 10e-3 * k
    assert res.prediction.step_time_s >= res.prediction.compute_s


def test_lstm_whole_on_every_rank_of_a_sample_group(lstm_profiled):
    """channel=2 splits no LSTM: each rank runs both towers whole for its sample group's samples."""
    # runnable_only=False: the pricing of a layout the runtime cannot run yet (a what-if)
    whole = plan_model(_model(), "localhost", 2, BATCH, strategy="channel=2", runnable_only=False).prediction.per_layer
    half = plan_model(_model(), "localhost", 2, BATCH, strategy="sample=2").prediction.per_layer
    for name in ("a", "b"):
        assert whole[name]["fwd_s"] > half[name]["fwd_s"] > 0  # the whole batch vs half of it
