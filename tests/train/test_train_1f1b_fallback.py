"""`hybridpar train` with a plan whose placer chose 1f1b but whose placement is not a chain of stages: the
run falls back to gpipe and says so, with what that changes (one `hybridpar: note:` line on stderr before
the ranks start, and in --json's notes): gpipe holds all K micro-batches' activations where 1F1B held S - s."""

from __future__ import annotations

import pytest
from tests.parallel import _1f1b_workers as w

from hybridpar.cli.main import main
from hybridpar.plans import LayerLayout, Plan
from hybridpar.plans.schema import Prediction

WORKERS = "tests/parallel/_1f1b_workers.py"


def _args(tmp_path, memory: list[int]) -> list[str]:
    Plan(model="mlp_back", world_size=2, dp=1, mp=2, batch=8, default_layout=LayerLayout(sample=1),
         placement=w.MODELS["mlp_back"][2], schedule="1f1b", micro_batches=4,
         predicted=Prediction(step_time_s=0.01, memory_bytes=memory)).save(tmp_path / "p.json")
    return ["train", "--model", f"{WORKERS}:chain_mlp", "--input-shape", "6", "--plan", str(tmp_path / "p.json"),
            "--nproc", "2", "--data", f"{WORKERS}:dataset", "--loss", f"{WORKERS}:custom_loss", "--batch", "8",
            "--steps", "1", "--json"]


class _Stop(Exception):
    pass


def test_fallback_note_is_printed_before_the_ranks_start(tmp_path, capsys, monkeypatch):
    from hybridpar.cli.commands import train as train_cmd

    def no_ranks(*_a, **_k):
        raise _Stop  # what is printed before the ranks start is the test; they need not run

    monkeypatch.setattr(train_cmd, "_run", no_ranks)
    with pytest.raises(_Stop):
        main(_args(tmp_path, [2**20, 2**20]))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "1f1b" in ln]
    assert len(lines) == 1 and lines[0].startswith("hybridpar: note: schedule: gpipe (the placer's 1f1b cannot run: ")
    assert "gpipe holds all 4 micro-batches' activations" in lines[0] and "place --schedule gpipe" in lines[0], lines
