"""Elementwise backward ops torch 2.13 gives DTensor no strategy for (ReLU6's hardtanh_backward, HF
MobileNet; Hardswish's, HF LeViT; Hardsigmoid's) get DTensor's pointwise strategy
(hybridpar.parallel.dtensor.rules.serve_pointwise): every split kept, nothing sent; pooling
backwards keep their samples and channels split (serve_planewise). Before, they ran
replicated and DTensor gathered both inputs over every mesh dim, the sample dim included, in each
backward (HF MobileNetV2 tiny, sample=2,filter=2: 937,424 allgather bytes planned, 2,042,832 sent)."""

from __future__ import annotations

import pytest
import torch

from hybridpar.train.launch import spawn

from . import _pointwise_backward_workers as W

STRATEGIES = ["sample=2,channel=2", "sample=2,filter=2", "channel=2,filter=2", "channel=4"]
ACTIVATIONS = ("relu6", "hswish", "hsigmoid", "pool")


@pytest.mark.parametrize("strategy", ["sample=2,filter=2", "channel=4"])
def test_nothing_is_gathered_and_the_plan_says_so(strategy):
    from hybridpar.parallel.check import dry_run
    from hybridpar.search.layers.planner import plan_model

    model, x, _ = W.build()
    run = dry_run(model, strategy, (x,), world_size=4)
    assert not [r for r in run.dtensor if r["module"] in ACTIVATIONS]
    res = plan_model((W.build()[0], (x,)), "localhost", gpus=4, batch=4, strategy=strategy)
    assert res.prediction.comm_bytes == run.total_bytes


def test_the_rules_keep_every_split_and_compute_as_one_process():
    """On a fake world (no collective has values): each rank's piece of the gradient equals that
    piece of one process's, and DTensor issued no collective. Pooling backwards too (served whole
    before, so DTensor gathered over the sample dim as well: an AvgPool2d, sample=2,filter=2, 4
    allgathers, 61,440 bytes for a [8, 16, 8, 8] input): they keep samples and channels split."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hybridpar.parallel.dtensor import rules
    from hybridpar.parallel.dtensor.log import DTensorCommLog

    rules.install()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2))
        full = torch.randn(6, 7, 8, 8, generator=torch.Generator().manual_seed(0)) * 4  # 7: uneven pieces
        pools = (lambda t: F.avg_pool2d(t, 2), lambda t: F.max_pool2d(t, 3, 2, 1),
                 lambda t: F.avg_pool3d(t.unsqueeze(2), (1, 2, 2)).squeeze(2))
        for op in (F.relu6, F.hardswish, F.hardsigmoid, F.hardshrink, F.softshrink, *pools):
            x = distribute_tensor(full, mesh, [Shard(0), Shard(1)]).requires_grad_()
            with DTensorCommLog(None) as rec:
                y = op(x)
                y.backward(torch.ones_like(y))
            one = full.clone().requires_grad_()
            op(one).sum().backward()
            assert (tuple(y.placements), tuple(x.grad.placements)) == ((Shard(0), Shard(1)),) * 2, op
            assert rec.records == [], op
            assert torch.equal(x.grad.to_local(), one.grad[:3, :4]), op
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_trains_like_one_process():
    """Real gloo ranks, every channel/filter layout: 4 SGD steps, weights as in one process."""
    bad = [rec for per_strategy in spawn(W.run, 4, STRATEGIES) for rec in per_strategy
           if "error" in rec or rec["err"] > 1e-4 or rec["out_err"] > 1e-4]
    assert not bad, bad
