"""A token model (embedding, transformer encoder layer, LSTM): the planner's predicted sample-only
gradient bytes equal the bytes `hybridpar train` sends (every trainable parameter counted)."""

from __future__ import annotations

import json

import pytest

from hybridpar.cli.main import main

MODEL = "tests/graph/data/user_models.py:tokens"


@pytest.mark.slow
def test_predicted_gradient_bytes_equal_bytes_sent(capsys):
    assert main(["plan", "--model", MODEL, "--strategy", "sample=2", "--gpus", "2", "--batch", "6", "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)["predicted"]["comm_bytes"]
    assert main(["train", "--model", MODEL, "--strategy", "sample=2", "--nproc", "2", "--batch", "6", "--steps", "2",
                 "--json"]) == 0
    sent = json.loads(capsys.readouterr().out)["steps"][-1]["comm_bytes"]
    assert predicted["allreduce"] == pytest.approx(sent["allreduce"], rel=0.01)
    assert sent["allreduce"] > 40_000  # embedding, attention, LSTM and norms included, not only the head
