"""`hybridpar train --precision fp64`: the model's floating weights and buffers and each batch's
inputs in float64, so that a layout can be checked against one process where float32 rounding alone
is beyond the tolerance. Under sample=2 (global batch norm: its allgather of statistics) and
channel=2 (channel-split convolutions and batch norm), 2 SGD steps equal a float64 one-process
reference to 1e-10: far below float32's own rounding (~1e-7), so a run that silently stayed in float32
fails."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.cli.main import main

SHAPE, BATCH, STEPS, LR = (3, 8, 8), 4, 2, 0.05
MODEL = """
from torch import nn
def net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
"""


def _net() -> nn.Module:
    scope: dict = {}
    exec(MODEL, scope)  # the file's model, built here for the reference
    return scope["net"]()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp64")
    (d / "net.py").write_text(MODEL)
    g = torch.Generator().manual_seed(5)
    data = {"x": torch.randn(STEPS * BATCH, *SHAPE, generator=g),
            "y": torch.randint(0, 10, (STEPS * BATCH,), generator=g)}
    torch.save(data, d / "data.pt")
    torch.manual_seed(2)
    init = _net().state_dict()
    torch.save(init, d / "init.pt")
    model = _net()
    model.load_state_dict(init)
    model.double()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        F.cross_entropy(model(data["x"][rows].double()), data["y"][rows]).backward()
        opt.step()
        opt.zero_grad()
    return d, model.state_dict()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["sample=2", "channel=2"])
def test_fp64_train_equals_float64_one_process(setup, strategy, capsys):
    d, want = setup
    out = d / f"{strategy.replace('=', '')}.pt"
    rc = main(["train", "--model", f"{d / 'net.py'}:net", "--input-shape", "3,8,8", "--strategy", strategy,
               "--nproc", "2", "--data", str(d / "data.pt"), "--batch", str(BATCH), "--steps", str(STEPS),
               "--lr", str(LR), "--no-shuffle", "--init-from", str(d / "init.pt"), "--save", str(out),
               "--precision", "fp64", "--json"])
    assert rc == 0, capsys.readouterr().err
    got = torch.load(out, weights_only=True)
    assert got.keys() == want.keys()
    for k, w in want.items():
        if w.is_floating_point():
            assert got[k].dtype == torch.float64, k
            assert float((got[k] - w).abs().max()) <= 1e-10, (k, float((got[k] - w).abs().max()))
        else:
            assert torch.equal(got[k], w), k


def test_bad_precision_exits_2(capsys):
    rc = main(["train", "--model", "small_cnn", "--strategy", "sample=1", "--steps", "1", "--precision", "fp8"])
    assert rc == 2
    assert "fp64" in capsys.readouterr().err  # the accepted values are named


def test_fp64_casts_floating_inputs_only():
    from hybridpar.train.optim import cast_inputs, to_precision

    m = to_precision(nn.BatchNorm1d(3), "fp64")
    assert m.weight.dtype == m.running_var.dtype == torch.float64 and m.num_batches_tracked.dtype == torch.long
    x = cast_inputs({"a": torch.ones(2), "ids": torch.ones(2, dtype=torch.long)}, "fp64")
    assert x["a"].dtype == torch.float64 and x["ids"].dtype == torch.long
    assert cast_inputs(torch.ones(2), "fp32").dtype == torch.float32
