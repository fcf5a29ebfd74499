"""Red-team leftovers of issue 33, item 14: `true` taken as 1 in a plan; a model's forward that prints
corrupting `train --json`. Each fails without its fix."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridpar.errors import UserError
from hybridpar.plans import load_plan

PRINTING = '''
import torch
from torch import nn


class Loud(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 10)

    def forward(self, x):
        print("forward says hello")  # user code that prints, in the launcher and in every rank
        return self.fc(self.conv(x).mean((2, 3)))


def model():
    return Loud(), torch.randn(2, 3, 8, 8)
'''


def _plan_dict() -> dict:
    return {"schema_version": 1, "model": "small_cnn", "world_size": 2, "batch": 8, "dp": 2,
            "default_layout": {"sample": 2}}


@pytest.mark.parametrize("where", ["batch", "world_size", "default_layout.sample"])
def test_true_is_not_one_in_a_plan(tmp_path, where):
    d = _plan_dict()
    load_plan(_write(tmp_path / "ok.json", d))  # the control: the same plan with numbers loads
    target = d
    *parents, leaf = where.split(".")
    for key in parents:
        target = target[key]
    target[leaf] = True
    with pytest.raises(UserError, match="true/false"):
        load_plan(_write(tmp_path / "p.json", d))


def _write(path, d):
    path.write_text(json.dumps(d))
    return path


@pytest.mark.slow  # two ranks
def test_a_printing_forward_leaves_train_json_parseable(tmp_path):
    # a fresh process: the ranks write to the file descriptors the launcher gives them
    f = tmp_path / "loud.py"
    f.write_text(PRINTING)
    r = subprocess.run([sys.executable, "-m", "hybridpar.cli.main", "train", "--model", f"{f}:model",
                        "--strategy", "sample=2", "--gpus", "2", "--batch", "4", "--steps", "1", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)  # stdout is the report alone
    assert r.stderr.count("forward says hello") >= 3  # the launcher's trace and dry run, and each rank
