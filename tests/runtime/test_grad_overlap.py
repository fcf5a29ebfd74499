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


def _bucket_model():
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1),
                         nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(256, 10))


BUCKET_TEST_BYTES = 4200  # small model: buckets of ~4 KiB, so there are several, filled across layers


def _runtime_buckets(strategies: list[str]) -> dict:
    import torch
    import torch.nn.functional as F

    import hybridpar

    out = {}
    for strategy in strategies:
        torch.manual_seed(0)
        model = hybridpar.parallelize(_bucket_model(), strategy)
        sync = model.hybridpar.grad_sync
        sync.bucket_bytes = BUCKET_TEST_BYTES
        x = torch.randn(8, 3, 8, 8)
        F.cross_entropy(model(x), torch.randint(0, 10, (8,))).backward()
        out[strategy] = [(len(ranks), b) for ranks, b in sync.buckets]
    return out


@pytest.mark.slow
def test_priced_buckets_are_the_runtimes():
    """The planner prices the gradient buckets GradSync launches: same bytes, same groups, same order
    (DP and channel/filter layouts; bias before weight, batch norms before their layer)."""
    import torch

    from hybridpar.search.layers.planner import planned_grad_buckets

    strategies = ["sample=4", "sample=2,filter=2", "sample=2,channel=2"]
    ran = spawn(_runtime_buckets, 4, strategies)  # rank 0's buckets
    for st in strategies:
        priced = planned_grad_buckets((_bucket_model(), torch.randn(8, 3, 8, 8)), st, gpus=4, batch=8,
                                      bucket_bytes=BUCKET_TEST_BYTES)
        assert len(priced) >= 2, priced
        assert [(s, b) for s, _, b in priced] == ran[st], (st, priced, ran[st])
