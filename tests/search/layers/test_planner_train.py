"""A plan from `hybridpar plan` runs through `hybridpar train --plan` and trains exactly like one process."""

from __future__ import annotations

import pytest
import torch

from hybridpar.cli.main import main
from hybridpar.plans import load_plan


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_planned_small_resnet_trains_like_a_single_process(tmp_path, monkeypatch):
    from hybridpar.graph.zoo import ZOO

    monkeypatch.setenv("HYBRIDPAR_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    init = tmp_path / "init.pt"
    torch.save(ZOO["small_resnet"].build().state_dict(), init)
    plan_path = tmp_path / "plan.json"
    # a memory limit just under data parallelism's need makes the planner mix channel/filter layouts
    # (at batch 8: at 16 small_resnet's activations outweigh its weights, and data parallelism needs least)
    from hybridpar.search.layers.planner import plan_model

    dp_need = plan_model("small_resnet", "localhost", 4, 8).baseline.memory_bytes[0]
    assert main(["plan", "--model", "small_resnet", "--cluster", "localhost", "--gpus", "4", "--batch", "8",
                 "--memory-limit", str(dp_need - 1), "--out", str(plan_path), "--json"]) == 0
    plan = load_plan(plan_path)
    assert any(lay.channel * lay.filter > 1 for lay in plan.layers.values())
    common = ["--batch", "8", "--steps", "2", "--lr", "0.1", "--no-shuffle", "--init-from", str(init),
              "--data", "synthetic", "--seed", "1", "--json"]
    assert main(["train", "--plan", str(plan_path), "--nproc", "4", "--save", str(tmp_path / "w4.pt"),
                 *common]) == 0
    assert main(["train", "--model", "small_resnet", "--strategy", "sample=1", "--nproc", "1",
                 "--save", str(tmp_path / "w1.pt"), *common]) == 0
    w4, w1 = torch.load(tmp_path / "w4.pt"), torch.load(tmp_path / "w1.pt")
    assert w4.keys() == w1.keys()
    for k in w1:
        if w1[k].is_floating_point():
            err = (w4[k] - w1[k]).norm() / max(w1[k].norm(), 1e-12)
            assert err <= 1e-4, k
