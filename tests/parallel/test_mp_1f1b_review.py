"""Review fixes of the pipelined step (pipeline.schedule): plain SGD (fp64) through 1F1B and torch's GPipe
equals one process (the micro-batch weighting 1 / (K x replicas) is what SGD's update scales with); step()
without a schedule names gpipe, not 1f1b, when the placement is not a chain; the shared checks."""

from __future__ import annotations

import pytest
import torch

from hybridpar.train.launch import spawn

from . import _1f1b_review_workers as rw


@pytest.mark.timeout(300)
def test_sgd_through_1f1b_and_gpipe_equals_one_process():
    cases = [("mlp", "1f1b", 4), ("mlp", "gpipe", 2)]
    out = spawn(rw.run_sgd, 2, cases)
    ref = rw.serial_sgd("mlp")
    for (name, schedule, k), state in zip(cases, out):
        for key, v in ref.items():
            torch.testing.assert_close(state[key], v, rtol=1e-9, atol=1e-10, msg=f"{name} {schedule} K={k}: {key}")


def test_step_without_a_schedule_names_gpipe():
    msg = spawn(rw.step_without_schedule_refused, 2, "mlp_back")
    assert msg.startswith("gpipe: ") and "chain of stages" in msg and "1f1b" not in msg, msg
    assert "model(...) and loss.backward()" in msg and "\n" not in msg, msg


def test_shared_checks_name_the_schedule():
    from hybridpar.errors import UserError
    from hybridpar.parallel.pipeline.schedule import check_even_micro_batches

    with pytest.raises(UserError, match=r"^gpipe: global batch 6 must divide evenly over sample=1 x 4"):
        check_even_micro_batches("gpipe", 6, 1, 4)
    with pytest.raises(UserError, match=r"^1f1b: global batch 8 must divide evenly over sample=2 x 3"):
        check_even_micro_batches("1f1b", 8, 2, 3)
    check_even_micro_batches("1f1b", 8, 2, 4)
