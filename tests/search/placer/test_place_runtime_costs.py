"""The placer prices what the MP runtime pays on localhost: the measured p2p transfer, the executor's
work per graph node, the loss allreduce per step, and the bytes a consumer really reads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridpar.cluster.calibration import Calibration, CollectiveFit, Measurement, save_calibration
from hybridpar.search.placer.api import build_problem, one_process_step_s, place_model


def _fit(kind: str, a: float, b: float) -> CollectiveFit:
    m = Measurement(median_s=a, p10_s=a, p90_s=a, repeats=1)
    return CollectiveFit(kind=kind, world_size=2, group_size=2, intercept_s=a, slope_s_per_byte=b,
                         sizes_bytes=[4, 8], times=[m, m], max_rel_residual=0.0)


@pytest.fixture
def calibrated(tmp_path, monkeypatch):
    path = tmp_path / "cal.json"
    save_calibration(Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10, mp_node_overhead_s=20e-6,
                                 collectives=[_fit("p2p", 300e-6, 1e-9), _fit("allreduce", 900e-6, 2e-9)]), path)
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(path))
    return path


class Towers(nn.Module):
    """Two LSTMs over one embedded sequence; only their last steps reach the classifier."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.a = nn.LSTM(8, 12, batch_first=True)
        self.b = nn.LSTM(8, 12, batch_first=True)
        self.fc = nn.Linear(24, 4)

    def forward(self, tokens):
        e = self.embed(tokens)
        return self.fc(torch.cat([self.a(e)[0][:, -1], self.b(e)[0][:, -1]], 1))


def _towers():
    return Towers(), (torch.randint(0, 16, (4, 10)),)


def test_localhost_prices_the_measured_p2p_executor_work_and_loss_allreduce(calibrated):
    model = _towers()
    prob, _, fine, *_ = build_problem(model, "localhost", 2, batch=4)
    assert prob.latency_s[0][1] == pytest.approx(300e-6) and prob.bw_Bps[0][1] == pytest.approx(1e9)
    assert prob.step_overhead_s == pytest.approx(900e-6 + 2e-9 * 4)  # the 4-byte loss allreduce
    assert len(prob.tasks) == len(fine)  # small enough to place uncoarsened
    for t in prob.tasks:  # the executor's work per node, in the node's forward
        assert t.overhead_s == (0.0 if fine.node(t.name).op == "input" else pytest.approx(20e-6))
    # one process running eagerly pays neither the executor's work nor the loss allreduce; both pay
    # the optimizer's calls once per step
    assert prob.update_call_s > 0
    assert one_process_step_s(prob) == pytest.approx(prob.serial_time_s(0) - sum(t.overhead_s for t in prob.tasks)
                                                     + prob.update_call_s)
    out = place_model(model, "localhost", 2, batch=4, solver="single")
    assert out.single_step_s == pytest.approx(one_process_step_s(prob))
    assert out.result.step_time_s == pytest.approx(prob.serial_time_s(0) + prob.step_overhead_s + prob.update_call_s)
    assert out.speedup < 1  # the MP runtime on one device is one process plus its own costs


def test_an_lstm_whose_last_step_is_read_sends_that_step(calibrated):
    prob, _, fine, *_ = build_problem(_towers(), "localhost", 2, batch=4)
    lstm = [t for t in prob.tasks if fine.node(t.name).op == "lstm"]
    assert len(lstm) == 2
    for t in lstm:
        assert t.out_bytes == 4 * 4 * 12  # [batch, hidden] of the last step, not [batch, steps, hidden]
