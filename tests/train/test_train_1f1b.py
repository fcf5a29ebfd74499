"""`hybridpar train --schedule 1f1b`: a chain MLP not in the zoo trains through torch.distributed.pipelining's
1F1B (the placer asked for a chain of stages) with AdamW and a custom loss, equal to one fp64 process;
1f1b on a placement that is not a chain, or without model parallelism, is one line before any rank starts."""

from __future__ import annotations

import json

import pytest
import torch
from tests.parallel import _1f1b_workers as w

from hybridpar.cli.main import main
from hybridpar.plans import LayerLayout, Plan

WORKERS = "tests/parallel/_1f1b_workers.py"
STEPS, BATCH, LR, WD = 3, 8, 0.01, 0.05


def _serial(init: dict) -> dict:
    model = w.chain_mlp().double()
    model.load_state_dict(init)
    data = w.dataset()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        x, y = data.tensors[0][step * BATCH:(step + 1) * BATCH], data.tensors[1][step * BATCH:(step + 1) * BATCH]
        w.custom_loss(model(x.double()), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_1f1b_equals_one_process(tmp_path, capsys):
    torch.manual_seed(2)
    init = w.chain_mlp().state_dict()
    torch.save(init, tmp_path / "init.pt")
    code = main(["train", "--model", f"{WORKERS}:chain_mlp", "--input-shape", "6", "--strategy", "mp=2",
                 "--micro-batches", "4", "--schedule", "1f1b", "--nproc", "2", "--data", f"{WORKERS}:dataset",
                 "--batch", str(BATCH), "--steps", str(STEPS), "--no-shuffle", "--optimizer", "adamw", "--lr", str(LR),
                 "--weight-decay", str(WD), "--loss", f"{WORKERS}:custom_loss", "--precision", "fp64",
                 "--init-from", str(tmp_path / "init.pt"), "--save", str(tmp_path / "out.pt"), "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    report = json.loads(out.out)
    comm = report["steps"][-1]["comm_bytes"]
    # torch's stages sent the activations; the user-loop path's output broadcast never ran
    assert comm.get("send", 0) > 0 and "broadcast" not in comm, comm
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    for key, v in _serial(init).items():
        torch.testing.assert_close(got[key], v, rtol=1e-9, atol=1e-10, msg=key)


def _one_line_exit_2(capsys, args: list[str], needle: str) -> None:
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err, err


def test_1f1b_on_a_placement_that_is_not_a_chain_is_one_line(tmp_path, capsys):
    Plan(model="mlp_back", world_size=2, dp=1, mp=2, batch=BATCH, default_layout=LayerLayout(sample=1),
         placement=w.MODELS["mlp_back"][2]).save(tmp_path / "p.json")
    _one_line_exit_2(capsys, ["--model", f"{WORKERS}:chain_mlp", "--input-shape", "6", "--plan",
                              str(tmp_path / "p.json"), "--nproc", "2", "--micro-batches", "4", "--schedule", "1f1b",
                              "--data", f"{WORKERS}:dataset", "--loss", f"{WORKERS}:custom_loss"], "chain of stages")


@pytest.mark.parametrize("args,needle", [
    (["--strategy", "sample=2", "--schedule", "1f1b"], "needs a model-parallel plan"),
    (["--strategy", "mp=2", "--schedule", "1f1b", "--micro-batches", "1"], "at least as many micro-batches"),
])
def test_bad_schedule_options_are_one_line(capsys, args, needle):
    _one_line_exit_2(capsys, ["--model", f"{WORKERS}:chain_mlp", "--input-shape", "6", "--nproc", "2",
                              "--batch", str(BATCH), *args], needle)
