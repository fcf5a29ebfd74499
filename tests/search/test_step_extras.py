"""The optimizer step (+ zero_grad, + the train loop's finiteness check) and the loss are priced
(hybridpar.cost.update): measured fits from the calibration on localhost, a labelled roofline
elsewhere; the per-layer planner adds them after the step's last collective, the placer to each device
(per tensor in the task's backward, the call once per device after its schedule)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridpar.cluster import load_cluster
from hybridpar.cluster.calibration import Calibration, StepFit, save_calibration
from hybridpar.cost.update import optimizer_kind, step_work
from hybridpar.errors import UserError
from hybridpar.profile.update import _fit, measure_update
from hybridpar.search.layers.planner import plan_model
from hybridpar.search.placer.api import build_problem, one_process_step_s

CALL, PER_TENSOR, PER_ELEM = 200e-6, 10e-6, 1e-9
LOSS_CALL, LOSS_PER_ELEM = 50e-6, 2e-9


def _cal(update: dict[str, StepFit] | None = None, loss: StepFit | None = None,
         guard: dict[str, StepFit] | None = None) -> Calibration:
    return Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10, update=update or {}, loss=loss,
                       guard=update if guard is None else guard)


def _halves(fit: StepFit, part: float) -> StepFit:
    return StepFit(call_s=fit.call_s * part, per_tensor_s=fit.per_tensor_s * part,
                   per_element_s=fit.per_element_s * part)


# the totals the tests price: a quarter of each from the optimizer step, three quarters from the guard
TOTALS = {"sgd": StepFit(call_s=CALL, per_tensor_s=PER_TENSOR, per_element_s=PER_ELEM),
          "momentum": StepFit(call_s=2 * CALL, per_tensor_s=2 * PER_TENSOR, per_element_s=0.0)}


@pytest.fixture
def fitted(tmp_path, monkeypatch):
    path = tmp_path / "cal.json"
    save_calibration(_cal({k: _halves(f, 0.25) for k, f in TOTALS.items()},
                          StepFit(call_s=LOSS_CALL, per_element_s=LOSS_PER_ELEM),
                          {k: _halves(f, 0.75) for k, f in TOTALS.items()}), path)
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(path))
    return path


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 10, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


PARAMS, TENSORS = 16 * 32 + 32 + 32 * 10, 3


def test_fit_recovers_exact_coefficients_and_clips_negatives():
    rows = [[1.0, c, c * s] for c, s in ((4, 10), (8, 10), (4, 100), (16, 50))]
    times = [2.0 + 0.5 * c + 0.01 * e for _, c, e in rows]
    assert _fit(rows, times) == pytest.approx([2.0, 0.5, 0.01])
    assert _fit([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]], [3.0, 2.0, 1.0])[1] == 0.0  # a falling time is noise


def test_measure_update_on_this_machine():
    got = measure_update(warmup=1, repeats=3)
    assert set(got["update"]) == {"sgd", "momentum", "adamw"}
    for fit in (*got["update"].values(), got["loss"]):
        assert all(v >= 0 for v in fit.values())
    # torch's CPU optimizers loop over tensors in Python: a tensor more costs time, as do its elements
    sgd = got["update"]["sgd"]
    assert sgd["per_tensor_s"] > 0 and sgd["call_s"] + 48 * sgd["per_tensor_s"] > 0
    # the guard screens every gradient, weight and optimizer slot: its elements cost time, more with
    # AdamW's two moments to screen than with plain SGD's none
    assert set(got["guard"]) == {"sgd", "momentum", "adamw"}
    g = {k: f["per_tensor_s"] * 8 + f["per_element_s"] * 8 * 262144 for k, f in got["guard"].items()}
    assert 0 < g["sgd"] < g["adamw"]


def test_the_guard_is_priced_with_the_update_and_a_file_without_it_is_not_used(tmp_path, monkeypatch):
    cl = load_cluster("localhost", gpus=2)
    k = cl.device.time_share
    update = {"sgd": StepFit(call_s=CALL, per_tensor_s=PER_TENSOR, per_element_s=PER_ELEM)}
    guard = {"sgd": StepFit(call_s=3 * CALL, per_tensor_s=0.0, per_element_s=5 * PER_ELEM)}
    loss = StepFit(call_s=LOSS_CALL, per_element_s=LOSS_PER_ELEM)
    path = tmp_path / "cal.json"
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(path))
    save_calibration(_cal(update, loss, guard), path)
    w = step_work(cl, "sgd")
    assert w.source == "measured"
    assert w.update_s(TENSORS, PARAMS) == pytest.approx(
        (4 * CALL + PER_TENSOR * TENSORS + 6 * PER_ELEM * PARAMS) * k)
    save_calibration(_cal(update, loss, {}), path)  # fitted without the guard: not priced as if it were free
    assert step_work(cl, "sgd").source == "roofline"


def test_step_work_measured_scaled_by_time_share_or_roofline(fitted):
    cl = load_cluster("localhost", gpus=2)
    w = step_work(cl, "sgd")
    k = cl.device.time_share
    assert w.source == "measured"
    assert w.update_s(TENSORS, PARAMS) == pytest.approx((CALL + PER_TENSOR * TENSORS + PER_ELEM * PARAMS) * k)
    assert w.loss_s(320) == pytest.approx((LOSS_CALL + LOSS_PER_ELEM * 320) * k)
    assert step_work(cl, "lars").update_call_s == pytest.approx(2 * CALL * k)  # LARS priced as momentum
    assert step_work(cl, optimizer_kind("sgd", 0.9)).update_call_s == pytest.approx(2 * CALL * k)
    assert step_work(cl, "adamw").source == "roofline"  # not measured in this file
    gpu = step_work(load_cluster("dgx1-v100", gpus=2), "sgd")
    assert gpu.source == "roofline" and gpu.update_per_tensor_s == 0.0 and gpu.update_per_element_s > 0


def test_planner_adds_update_and_loss_to_every_layout(fitted):
    k = load_cluster("localhost", gpus=2).device.time_share
    batch = 8
    for strategy, elems in (("sample=2", PARAMS), ("filter=2", None)):
        res = plan_model((Net(), (torch.randn(batch, 16),)), "localhost", 2, batch, strategy=strategy)
        layers = sum(v["fwd_s"] + v["bwd_s"] for v in res.prediction.per_layer.values())
        extra = res.prediction.compute_s - layers
        loss = (LOSS_CALL + LOSS_PER_ELEM * batch * 10 / (2 if strategy == "sample=2" else 1)) * k
        if elems is not None:  # sample: every rank holds the whole model
            assert extra == pytest.approx((CALL + PER_TENSOR * TENSORS + PER_ELEM * elems) * k + loss)
        else:  # filter: each rank holds half of each weight, still all three tensors
            assert (CALL + PER_TENSOR * TENSORS) * k + loss < extra < \
                (CALL + PER_TENSOR * TENSORS + PER_ELEM * PARAMS) * k + loss
    one = plan_model((Net(), (torch.randn(batch, 16),)), "localhost", 1, batch, strategy="sample=1")
    layers = sum(v["fwd_s"] + v["bwd_s"] for v in one.prediction.per_layer.values())
    assert one.prediction.step_time_s >= layers + (CALL + PER_TENSOR * TENSORS) * k


def test_placer_prices_update_per_device_and_loss_on_the_output(fitted):
    model = (Net(), (torch.randn(8, 16),))
    prob, _, fine, *_ = build_problem(model, "localhost", 2, batch=8, optimizer="sgd")
    k = load_cluster("localhost", gpus=2).device.time_share
    assert prob.update_call_s == pytest.approx(CALL * k)
    bare, *_ = build_problem(model, "localhost", 2, batch=8, optimizer="momentum")  # per element 0 there
    per_tensor = sum(t.bwd_s[0] for t in prob.tasks) - sum(t.bwd_s[0] for t in bare.tasks)
    assert per_tensor == pytest.approx((-PER_TENSOR * TENSORS + PER_ELEM * PARAMS) * k)
    # the loss rides on the output's forward; one process pays every part once
    assert one_process_step_s(prob) == pytest.approx(
        sum(t.fwd_s[0] + t.bwd_s[0] - t.overhead_s for t in prob.tasks) + CALL * k)
    fwd = {t.name: t.fwd_s[0] for t in prob.tasks}
    (out,) = fine.outputs
    assert fwd[out] >= (LOSS_CALL + LOSS_PER_ELEM * 8 * 10) * k
    with pytest.raises(UserError, match="optimizer must be one of"):
        build_problem(model, "localhost", 2, batch=8, optimizer="rmsprop")


def test_cli_place_takes_the_optimizer(fitted, capsys):
    import json

    from hybridpar.cli.main import main

    rc = main(["place", "--model", "lstm2", "--devices", "2", "--solver", "single", "--optimizer", "sgd", "--json"])
    assert rc in (0, None)
    notes = json.loads(capsys.readouterr().out)["cost_notes"]
    head = "optimizer step (sgd) + zero_grad + train's NaN/Inf check: 200 us per device"
    assert any(n.startswith(head) and "(measured)" in n for n in notes)
    assert main(["place", "--model", "lstm2", "--devices", "2", "--optimizer", "rmsprop"]) == 2
    assert "'--optimizer': 'rmsprop' is not one of" in capsys.readouterr().err


def test_cli_plan_takes_the_runs_optimizer(fitted, capsys):
    """`plan` takes train's --optimizer/--momentum/--weight-decay: the same prediction as plan_model given
    them, a momentum buffer in memory and momentum's update in the step; bad values exit 2."""
    import json

    from hybridpar.cli.main import main

    got = {}
    for name, flags in (("sgd", []), ("momentum", ["--momentum", "0.9"]), ("adamw", ["--optimizer", "adamw"])):
        rc = main(["plan", "--model", "lstm2", "--cluster", "localhost", "--gpus", "2", "--batch", "8",
                   "--strategy", "sample=2", "--json", *flags])
        assert rc in (0, None)
        got[name] = json.loads(capsys.readouterr().out)["predicted"]
    api = plan_model("lstm2", "localhost", 2, 8, strategy="sample=2", optimizer="sgd", momentum=0.9).prediction
    assert got["momentum"]["step_time_s"] == pytest.approx(api.step_time_s)
    assert got["momentum"]["memory_bytes_per_device"] == api.memory_bytes[0]
    assert got["sgd"]["memory_bytes_per_device"] < got["momentum"]["memory_bytes_per_device"] \
        < got["adamw"]["memory_bytes_per_device"]  # 0, 1 and 2 state copies of the weights
    assert got["sgd"]["step_time_s"] != pytest.approx(got["momentum"]["step_time_s"])  # another update fit
    assert main(["plan", "--model", "lstm2", "--gpus", "2", "--momentum", "-1"]) == 2
    assert "--momentum and --weight-decay must be >= 0" in capsys.readouterr().err
