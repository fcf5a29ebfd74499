"""Gradient buckets are allreduced while backward is still running (issue: hide communication)."""

from __future__ import annotations

import pytest

from hybridpar.runtime.launch import spawn


def _overlap(strategy: str) -> dict:
    import time

    import torch
    import torch.nn.functional as F
    from torch import nn

    import hybridpar

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 10))
    hybridpar.parallelize(model, strategy)
    sync = model.hybridpar.grad_sync
    sync.bucket_bytes = 1  # every parameter its own bucket: launched the moment its gradient is ready
    x = torch.randn(8, 3, 8, 8, requires_grad=True)
    stamps = {}
    def mark(_grad):  # the input's gradient is the last thing backward computes
        stamps.setdefault("input_grad", time.perf_counter())

    x.register_hook(mark)
    F.cross_entropy(model(x), torch.randint(0, 10, (8,))).backward()
    return {"launches": list(sync.launch_times), "input_grad": stamps["input_grad"],
            "synced": all(p.grad is not None for p in model.parameters())}


@pytest.mark.slow
def test_bucket_allreduce_starts_before_backward_ends():
    r = spawn(_overlap, 2, "sample=2")  # rank 0's record
    assert r["synced"]
    assert len(r["launches"]) >= 4
    assert min(r["launches"]) < r["input_grad"], r
