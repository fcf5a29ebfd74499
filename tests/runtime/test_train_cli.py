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


def _plan(tmp_path, world=2, batch=8):
    from hybridpar.plans import LayerLayout, Plan

    Plan(model="small_cnn", world_size=world, dp=world, batch=batch,
         default_layout=LayerLayout(sample=world)).save(tmp_path / "p.json")
    return str(tmp_path / "p.json")


def test_plan_batch_mismatch_is_one_line_exit_2(tmp_path, capsys):
    assert main(["train", "--plan", _plan(tmp_path), "--batch", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--batch 16 disagrees with the plan's batch 8" in err, err


@pytest.mark.slow
def test_plan_alone_gives_batch_and_rank_count(tmp_path, capsys):
    import json

    assert main(["train", "--plan", _plan(tmp_path), "--steps", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["world_size"], doc["batch"], len(doc["steps"])) == (2, 8, 2)
    assert doc["param_bytes_per_rank"] and len(doc["param_bytes_per_rank"]) == 2


def test_run_config_is_the_library_face(tmp_path):
    """The same checks without the command line: library words, `param` naming the option."""
    from hybridpar.errors import UserError
    from hybridpar.runtime.run_config import run_config

    setup = run_config(plan=_plan(tmp_path, world=1, batch=4), steps=3)
    assert (setup.world_size, setup.config.batch, setup.total_steps, setup.start_step) == (1, 4, 3, 0)
    with pytest.raises(UserError) as err:
        run_config(plan=_plan(tmp_path, world=1, batch=4), batch=5)
    assert err.value.param == "batch" and str(err.value).startswith("batch 5 disagrees")
    with pytest.raises(UserError) as err:
        run_config(model="small_cnn", strategy="sample=1", lr=float("nan"))
    assert err.value.param == "lr"
