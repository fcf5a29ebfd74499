"""`hybridpar train` rejects bad input with one line and exit 2, before any process starts."""

from __future__ import annotations

import pytest
import torch

from hybridpar.cli.main import main


@pytest.mark.parametrize("args,needle", [
    (["--model", "small_cnn", "--strategy", "sample=3", "--nproc", "2"], "uses 3 ranks"),
    (["--model", "small_cnn", "--strategy", "sample=4", "--nproc", "4", "--batch", "6"], "not divisible"),
    (["--model", "small_cnn", "--nproc", "2"], "exactly one of --strategy or --plan"),
    (["--model", "nope", "--strategy", "sample=2", "--nproc", "2"], "unknown model"),
    (["--model", "small_cnn", "--strategy", "sample=2", "--nproc", "2", "--steps", "2", "--epochs", "1"],
     "not both"),
    (["--model", "small_cnn", "--strategy", "sample=2", "--nproc", "2", "--data", "imagenet"],
     "synthetic, digits"),
    (["--model", "small_cnn", "--strategy", "channel=2", "--nproc", "2", "--batch", "0"], ">= 1"),
    (["--model", "small_cnn", "--strategy", "channel=2", "--nproc", "2", "--synthetic-size", "4"],
     "fewer than batch"),
])
def test_bad_input_is_one_line_exit_2(capsys, args, needle):
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err


def test_init_from_mismatch_rejected(tmp_path, capsys):
    torch.save({"weight": torch.zeros(3)}, tmp_path / "s.pt")
    rc = main(["train", "--model", "small_cnn", "--strategy", "sample=2", "--nproc", "2",
               "--init-from", str(tmp_path / "s.pt")])
    assert rc == 2
    assert "does not match the model" in capsys.readouterr().err


def test_depthwise_conv_rejected_for_its_own_channel_layout(tmp_path, capsys):
    """A grouped/depthwise conv runs replicated inside a channel layout; a plan that gives it a layout of
    its own is refused before any rank starts."""
    from hybridpar.plans import LayerLayout, Plan

    f = tmp_path / "m.py"
    f.write_text("from torch import nn\n"
                 "def net():\n    return nn.Sequential(nn.Conv2d(4, 4, 3, groups=4), nn.Flatten(), nn.LazyLinear(2))\n")
    Plan(model=f"{f}:net", input_shape=[4, 8, 8], world_size=2, dp=2, batch=8,
         default_layout=LayerLayout(channel=2), layers={"0": LayerLayout(channel=2)}).save(tmp_path / "p.json")
    rc = main(["train", "--plan", str(tmp_path / "p.json")])
    assert rc == 2
    assert "depthwise" in capsys.readouterr().err


def test_plan_world_mismatch_rejected(tmp_path, capsys):
    from hybridpar.plans import LayerLayout, Plan

    Plan(model="small_cnn", world_size=4, dp=4, batch=8, default_layout=LayerLayout(sample=4)).save(tmp_path / "p.json")
    assert main(["train", "--plan", str(tmp_path / "p.json"), "--nproc", "2"]) == 2
    assert "plan is for 4 ranks" in capsys.readouterr().err
