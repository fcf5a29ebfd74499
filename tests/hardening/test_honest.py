"""Issue 33, honest tests: controls that make the suite's claims able to fail."""

from __future__ import annotations

import json

import pytest
import torch

from hybridpar.cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

# A model whose forward draws from Python's `random`: in each rank (forked) it is reseeded from the OS,
# so only --deterministic (which seeds it from --seed and the rank) makes two runs agree.
_NOISY = """
import random
import torch

class Noisy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.l(x) * (1 + 1e-2 * random.random())

def make():
    return Noisy()
"""


def _run(tmp_path, capsys, name: str, *flags: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    f = tmp_path / "noisy.py"
    f.write_text(_NOISY)
    out = tmp_path / f"{name}.pt"
    code = main(["train", "--model", f"{f}:make", "--input-shape", "4", "--strategy", "sample=1", "--nproc", "1",
                 "--batch", "4", "--steps", "2", "--json", "--save", str(out), *flags])
    text = capsys.readouterr()
    assert code == 0, text.err
    return [s["loss"] for s in json.loads(text.out)["steps"]], torch.load(out, weights_only=True)


def test_deterministic_has_a_negative_control(tmp_path, capsys):
    """Without --deterministic two runs of this model differ; with it they are bitwise equal (patching
    the flag out of the trainer fails the second half)."""
    loose = [_run(tmp_path, capsys, f"loose{i}") for i in range(2)]
    assert loose[0][0] != loose[1][0], "the control: without --deterministic the runs should differ"
    tight = [_run(tmp_path, capsys, f"tight{i}", "--deterministic") for i in range(2)]
    assert tight[0][0] == tight[1][0]
    assert all(torch.equal(tight[0][1][k], tight[1][1][k]) for k in tight[0][1])
