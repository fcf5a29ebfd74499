"""Gradient buckets are allreduced while backward is still running (issue: hide communication)."""

from __future__ import annotations

import pytest

from hybridpar.train.launch import spawn


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


def _loss_rides(strategy: str) -> dict:
    """Two steps of the training engine on 4 ranks (no optimizer step): the second step's reported loss
    against the global batch's mean loss computed by every rank on the whole batch, and its collectives."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from hybridpar.train.engine import ChannelFilterEngine

    torch.manual_seed(0)
    model = _bucket_model()
    serial = _bucket_model()
    serial.load_state_dict(model.state_dict())
    eng = ChannelFilterEngine(model, strategy, bn_stats="global")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
    eng.train_step(*eng.local_batch(x, y))  # the first step of a DTensor layout watches DTensor's collectives
    with torch.no_grad():
        for p in eng.parameters():
            p.grad = None
    reported = eng.train_step(*eng.local_batch(x, y))  # no optimizer step: same weights
    recs = eng.comm_log.step_records()
    expected = float(F.cross_entropy(serial(x), y))
    return {"reported": reported, "expected": expected, "rank": dist.get_rank(),
            "loss": [(r.kind, r.group_size, r.bytes_, r.seconds) for r in recs if r.tag == "loss"],
            "grad_kinds": sorted({r.kind for r in recs if r.tag == "grad_sync"})}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["sample=4", "sample=2,channel=2"])
def test_loss_rides_in_a_gradient_bucket(strategy):
    """The reported loss goes with the gradients (GradSync.carry): logged as its own 4-byte allreduce
    over the sample groups, with no time of its own (no collective of its own), and it is the global
    batch's mean loss."""
    r = spawn(_loss_rides, 4, strategy)
    assert r["grad_kinds"] == ["allreduce"]
    groups = 4 if strategy == "sample=4" else 2
    assert r["loss"] == [("allreduce", groups, 4, 0.0)], r
    assert abs(r["reported"] - r["expected"]) < 1e-5 * max(1.0, abs(r["expected"])), r
