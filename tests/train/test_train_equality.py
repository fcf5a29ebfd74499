"""`hybridpar train` for 5 SGD steps equals plain single-process PyTorch SGD (acceptance test)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridpar.cli.main import main
from hybridpar.graph.zoo.small import small_resnet

SHAPE = (3, 16, 16)
STEPS, BATCH, LR, MOMENTUM = 5, 8, 0.05, 0.9


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    g = torch.Generator().manual_seed(7)
    data = {"x": torch.randn(STEPS * BATCH, *SHAPE, generator=g),
            "y": torch.randint(0, 10, (STEPS * BATCH,), generator=g)}
    torch.save(data, d / "data.pt")
    torch.manual_seed(3)
    init = small_resnet(width=8).state_dict()
    torch.save(init, d / "init.pt")
    return d, data, init


def serial_sgd(data, init):
    torch.manual_seed(0)
    model = small_resnet(width=8)
    model.load_state_dict(init)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    model.train()
    for step in range(STEPS):
        x, y = data["x"][step * BATCH:(step + 1) * BATCH], data["y"][step * BATCH:(step + 1) * BATCH]
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _model_file(d):
    path = d / "net.py"
    path.write_text("from hybridpar.graph.zoo.small import small_resnet\n"
                    "def net():\n    return small_resnet(width=8)\n")
    return f"{path}:net"


@pytest.mark.slow
@pytest.mark.parametrize("strategy,nproc", [
    ("sample=4", 4), ("sample=2,channel=2", 4), ("sample=2,filter=2", 4), ("channel=2,filter=2", 4),
    ("channel=4", 4),
])
def test_train_matches_serial_sgd(setup, strategy, nproc):
    d, data, init = setup
    out = d / f"final-{strategy.replace(',', '_').replace('=', '')}.pt"
    rc = main(["train", "--model", _model_file(d), "--input-shape", "3,16,16", "--strategy", strategy,
               "--nproc", str(nproc), "--data", str(d / "data.pt"), "--batch", str(BATCH), "--steps", str(STEPS),
               "--lr", str(LR), "--momentum", str(MOMENTUM), "--no-shuffle", "--init-from", str(d / "init.pt"),
               "--save", str(out), "--json"])
    assert rc == 0
    got = torch.load(out, weights_only=True)
    want = serial_sgd(data, init)
    assert got.keys() == want.keys()
    for k, w in want.items():
        if w.is_floating_point():
            rel = float((got[k] - w).norm() / w.norm().clamp_min(1e-30))
            assert rel <= 1e-4, (k, rel)
        else:
            assert torch.equal(got[k], w), k
