"""1F1B (and GPipe) through torch.distributed.pipelining (pipeline.schedule): chain models trained by
`model.hybridpar.step` with AdamW and a custom loss equal one fp64 process; a placement that is not a chain
of stages is refused with one line; K below the stage count is refused."""

from __future__ import annotations

import pytest
import torch

from hybridpar.train.launch import spawn

from . import _1f1b_workers as w


def _check_equal(cases, out) -> None:
    for (name, schedule, k, dtype), res in zip(cases, out):
        ref, ref_losses = w.serial(name, dtype)
        for key, v in ref.items():
            torch.testing.assert_close(res["state"][key], v, rtol=1e-9, atol=1e-10, msg=f"{name} {schedule}: {key}")
        assert res["losses"] == pytest.approx(ref_losses, rel=1e-9), f"{name} {schedule} K={k}"
        assert res["micro"] == w.STEPS * k  # each micro-batch's own loss reported


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_1f1b_cnn_and_stages_in_the_other_order_equal_one_process():
    cases = [("cnn", "1f1b", 2, torch.float64), ("mlp_flip", "1f1b", 2, torch.float64)]
    _check_equal(cases, spawn(w.run_step, 2, cases))


@pytest.mark.timeout(300)
def test_1f1b_and_gpipe_steps_equal_one_process():
    cases = [("mlp", "1f1b", 4, torch.float64), ("mlp", "gpipe", 2, torch.float64)]
    out = spawn(w.run_step, 2, cases)
    # the last step's order on stages 0 and 1: 1F1B keeps at most S - s micro-batches in flight, GPipe all
    assert out[0]["order"] == ["FFBFBFBB", "FBFBFBFB"]
    assert out[1]["order"] == ["FFBB", "FFBB"]
    # stage 0's last step: K=4 activations of [2, 16] fp64 sent to device 1, their gradients received
    act = 2 * 16 * 8
    assert out[0]["p2p"] == [("recv", "bwd:dev1", act)] * 4 + [("send", "fwd:dev1", act)] * 4
    _check_equal(cases, out)


def test_not_a_chain_refused_on_every_rank():
    msgs = spawn(w.refused, 2, "mlp_back")
    assert len(msgs) == 2, msgs
    assert all("chain of stages" in m and "--schedule gpipe" in m and "\n" not in m for m in msgs), msgs


def test_1f1b_needs_micro_batches_at_least_stages():
    from hybridpar.errors import UserError
    from hybridpar.parallel.pipeline.schedule import check_schedule

    with pytest.raises(UserError, match="at least as many micro-batches as stages"):
        check_schedule("1f1b", 1, 2)
    with pytest.raises(UserError, match="schedule must be one of"):
        check_schedule("zb", 4, 2)
    check_schedule("1f1b", 2, 2)
    check_schedule("gpipe", 1, 2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_1f1b_with_sample_replicas_equals_one_process():
    """mp=2 x sample=2: each replica's 1F1B, the weights' gradients summed over the replicas once, in the
    last micro-batch's backward."""
    res = spawn(w.run_hybrid, 4, 2)
    ref, ref_losses = w.serial("mlp", torch.float64)
    for key, v in ref.items():
        torch.testing.assert_close(res["state"][key], v, rtol=1e-9, atol=1e-10, msg=key)
    assert res["losses"] == pytest.approx(ref_losses, rel=1e-9)


class _InputSkip(torch.nn.Module):
    """The input read again by the second stage: not a chain."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x) + x)


@pytest.mark.parametrize("placement,want", [
    ({"b": 1, "add": 1}, "input x is read on device 1"),
    ({"a": 0, "b": 0, "add": 0}, "device 1 of mp=2 runs no layer"),
    ({"a": 0, "add": 0, "b": 1}, (0, 1)),
    ({"a": 1, "add": 1, "b": 0}, (1, 0)),  # stages in the other order: a chain too
])
def test_chain_order_names_what_breaks_the_chain(placement, want):
    from hybridpar.errors import UserError
    from hybridpar.parallel.pipeline.partition import partition_module
    from hybridpar.parallel.pipeline.schedule import chain_order

    part = partition_module(_InputSkip(), placement, 2)
    if isinstance(want, tuple):
        assert chain_order(part) == want
        return
    with pytest.raises(UserError, match=want) as err:
        chain_order(part)
    assert "\n" not in str(err.value)


class _IntCrossing(torch.nn.Module):
    """Stage 0 sends an integer tensor (a class index) along with the activations: no gradient for it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Embedding(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h.argmax(1)) + h


def test_settle_schedule_refuses_asked_and_falls_back_for_the_placers():
    from hybridpar.errors import UserError
    from hybridpar.parallel.pipeline.schedule import settle_schedule
    from hybridpar.plans import Plan

    def plan(placement, schedule=None):
        return Plan(model="m", world_size=2, batch=8, dp=1, mp=2, placement=placement, schedule=schedule,
                    default_layout={"sample": 1})

    x = (torch.randn(8, 4),)
    skip = plan({"b": 1, "add": 1}, "1f1b")  # the placer's 1f1b on a placement that is not a chain
    settled = settle_schedule(_InputSkip(), skip, None, 8, 2, x)
    assert settled.schedule == "gpipe" and "the placer's 1f1b cannot run" in settled.notes[-1]
    with pytest.raises(UserError, match="input x is read on device 1"):
        settle_schedule(_InputSkip(), skip, "1f1b", 8, 2, x)
    with pytest.raises(UserError, match="without a gradient"):
        settle_schedule(_IntCrossing(), plan({"b": 1, "add": 1}), "1f1b", 8, 2, x)
    with pytest.raises(UserError, match="divide evenly"):
        settle_schedule(_InputSkip(), plan({"b": 1}), "1f1b", 6, 4, x)
    assert settle_schedule(_InputSkip(), plan({"a": 0, "add": 0, "b": 1}), "1f1b", 8, 2, x).schedule == "1f1b"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_placer_places_for_1f1b_through_parallelize():
    res = spawn(w.run_placed, 2, 2)
    assert res["schedule"] == "1f1b" and sorted(set(res["placement"].values())) == [0, 1]
    ref, ref_losses = w.serial("mlp", torch.float64)
    for key, v in ref.items():
        torch.testing.assert_close(res["state"][key], v, rtol=1e-9, atol=1e-10, msg=key)
    assert res["losses"] == pytest.approx(ref_losses, rel=1e-9)
