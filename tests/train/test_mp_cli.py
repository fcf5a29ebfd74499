"""`hybridpar train --strategy mp=2,sample=2` end to end: the placer picks the placement, 4 gloo
ranks train hybrid DP x MP, and --save equals single-process SGD from the same --init-from."""

from __future__ import annotations

import json

import pytest
import torch

from hybridpar.cli.main import main
from hybridpar.graph.models import load_model

STEPS, BATCH, LR, MOMENTUM = 5, 8, 0.05, 0.9


def serial_sgd(model, data, *, steps: int, batch: int, lr: float, momentum: float) -> list[float]:
    """Plain single-process SGD over data["x"/"y"] in file order (the --no-shuffle contract);
    the per-step losses. The reference every MP train test compares --save against."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for i in range(steps):
        x, y = data["x"][i * batch:(i + 1) * batch], data["y"][i * batch:(i + 1) * batch]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_hybrid_strategy_matches_serial(tmp_path, capsys):
    g = torch.Generator().manual_seed(3)
    data = {"x": torch.randn(STEPS * BATCH, 3, 16, 16, generator=g),
            "y": torch.randint(0, 10, (STEPS * BATCH,), generator=g)}
    torch.save(data, tmp_path / "data.pt")
    torch.manual_seed(7)
    model = load_model("inception_mini").module
    torch.save(model.state_dict(), tmp_path / "init.pt")

    code = main(["train", "--model", "inception_mini", "--input-shape", "3,16,16",
                 "--strategy", "mp=2,sample=2", "--nproc", "4", "--data", str(tmp_path / "data.pt"),
                 "--batch", str(BATCH), "--steps", str(STEPS), "--no-shuffle", "--lr", str(LR),
                 "--momentum", str(MOMENTUM), "--init-from", str(tmp_path / "init.pt"),
                 "--save", str(tmp_path / "out.pt"), "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["steps"]) == STEPS

    losses = serial_sgd(model, data, steps=STEPS, batch=BATCH, lr=LR, momentum=MOMENTUM)
    saved = torch.load(tmp_path / "out.pt", weights_only=True)
    ref = model.state_dict()
    assert saved.keys() == ref.keys()
    for k in ref:
        err = ((saved[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)).item()
        assert err <= 1e-4, f"{k}: rel err {err:.2e}"
    assert [s["loss"] for s in report["steps"]] == pytest.approx(losses, rel=1e-4)
