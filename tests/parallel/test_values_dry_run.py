"""A forward that reads tensor values (a Python branch on a mask, indices from `torch.arange`) under a
channel/filter layout: the pre-start check, which runs on meta tensors, repeats itself with values on
CPU copies, and the run equals one process (issue: global semantics; HF GPT-2 does both)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hybridpar
from hybridpar.cli.main import main
from hybridpar.errors import UserError
from hybridpar.parallel import check as dr

from .fp64_runs import train_fp64
from .value_models import example_ids, last_token

MODEL = f"{Path(__file__).with_name('value_models.py')}:last_token"


def test_check_runs_a_value_reading_forward_with_values():
    model, _ = last_token()
    run = hybridpar.check(model, "channel=2", example_ids(), torch.arange(4), world_size=2)
    assert run.output_shapes == [(4, 10)]


def test_too_large_for_a_values_run_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(dr, "VALUES_RUN_MAX_PARAMS", 10)
    model, _ = last_token()
    with pytest.raises(UserError) as err:
        hybridpar.check(model, "channel=2", example_ids(), world_size=2)
    text = str(err.value)
    assert "reads tensor values" in text and "up to 10 parameters" in text and "\n" not in text


def test_weights_on_meta_are_refused_with_the_reason():
    model, _ = last_token()
    with pytest.raises(UserError, match="reads tensor values.*weights are on the CPU"):
        hybridpar.check(model.to("meta"), "channel=2", example_ids(), world_size=2)


def _train(tmp_path, capsys, strategy: str, n: str):
    weights, losses, _ = train_fp64(tmp_path, capsys, MODEL, strategy, n)
    return weights, losses


@pytest.mark.slow
def test_train_channel_split_equals_one_process(tmp_path, capsys):
    two, loss2 = _train(tmp_path, capsys, "channel=2", "2")
    one, loss1 = _train(tmp_path, capsys, "sample=1", "1")
    assert loss2 == pytest.approx(loss1, rel=1e-9)
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")
    assert loss1[0] != loss1[-1]  # it trained


def test_model_parallel_needs_a_graph_refused_before_the_placer(capsys, monkeypatch):
    """The MP runtime runs torch.fx's graph, else torch.export's; a forward that branches on values has
    neither: one line, exit 2, before the placer runs or a rank starts (it crashed in the placer with
    a traceback; export's failure prints a whole graph on stderr, kept out of it)."""
    import hybridpar.search.placer as placer_api

    def no_placer(*_a, **_k):
        raise AssertionError("the placer ran")
    monkeypatch.setattr(placer_api, "place_model", no_placer)
    code = main(["train", "--model", MODEL, "--strategy", "mp=2", "--nproc", "2", "--batch", "8", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "torch.fx-traceable or torch.export-able" in err, err
