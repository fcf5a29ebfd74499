"""`hybridpar train` in fp64 through the CLI, for checks against one process to ~1e-9."""

from __future__ import annotations

import json

import torch

from hybridpar.cli.main import main


def train_fp64(tmp_path, capsys, model: str, strategy: str, nproc: str, *, batch: int = 8, steps: int = 3):
    """(saved weights, losses per step, the --json result) of a short fp64 run."""
    out = tmp_path / f"{strategy.replace(',', '_').replace('=', '')}.pt"
    code = main(["train", "--model", model, "--strategy", strategy, "--nproc", nproc, "--batch", str(batch),
                 "--steps", str(steps), "--no-shuffle", "--precision", "fp64", "--save", str(out), "--json"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    res = json.loads(cap.out)
    return torch.load(out, weights_only=True), [s["loss"] for s in res["steps"]], res
