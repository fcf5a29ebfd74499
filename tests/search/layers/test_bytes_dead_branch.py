"""A branch whose result the loss does not use (Hugging Face SigLIP's attention-pooling head when
the classifier averages the tokens instead): it runs forward, autograd never reaches it. The
runtime then sends no gradient for its replicated (DTensor) parameters and issues none of its
backward collectives, but still sums zeros for its split layers' local shards (every rank issues
the same buckets). The planner priced all of it (HF siglip tiny, 4 ranks, sample=2,filter=2,
batch 4: 2,381,976 / 64,512 allreduce / reduce-scatter bytes planned, 1,786,776 / 56,832 sent)."""

from __future__ import annotations

import pytest
import torch
from torch import nn


class DeadBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)  # replicated under a channel/filter layout
        self.aux = nn.Linear(32, 8)  # split under a channel/filter layout
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.body(x))
        self.unused = self.aux(self.norm(h))  # computed, never part of the output
        return self.head(h)


@pytest.mark.parametrize("strategy", ["sample=2,filter=2", "sample=4"])
def test_planned_bytes_equal_the_runtimes(strategy):
    from hybridpar.parallel.check import dry_run
    from hybridpar.search.layers.planner import plan_model

    x = torch.randn(8, 16)
    res = plan_model((DeadBranch(), (x,)), "localhost", gpus=4, batch=8, strategy=strategy)
    # every byte sent: the norm's forward gather of its split input (DTensor's) is priced too
    assert res.prediction.comm_bytes == dry_run(DeadBranch(), strategy, (x,), world_size=4).total_bytes


def test_the_listing_says_so():
    from hybridpar.search.layers.planner import plan_model

    res = plan_model((DeadBranch(), (torch.randn(8, 16),)), "localhost", gpus=4, batch=8,
                     strategy="sample=2,filter=2")
    sent = {g.module: g.allreduce_bytes for g in res.gradients}
    assert sent["norm"] == 0 and sent["aux"] > 0  # replicated: nothing; a local shard: zeros summed
    assert sum(sent.values()) == res.breakdown.grad_bytes


class Embeddings(nn.Module):
    """A parameter no op reads (HF Dinov2's mask_token when no mask is given): the tracer gives it to
    the module's first node, a split linear."""

    def __init__(self):
        super().__init__()
        self.mask_token = nn.Parameter(torch.zeros(1, 16))
        self.proj = nn.Linear(16, 32)

    def forward(self, x):
        return self.proj(x)


class WithUnreadParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = Embeddings()
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.relu(self.embeddings(x)))


@pytest.mark.parametrize("strategy", ["sample=2,filter=2", "sample=4"])
def test_an_unread_parameter(strategy):
    """Under a channel/filter layout it is a replicated DTensor with no gradient: nothing sent (was
    priced with the linear's shard: HF dinov2 tiny 768 bytes); sample-only: zeros summed, as priced."""
    from hybridpar.parallel.check import dry_run
    from hybridpar.search.layers.planner import plan_model

    x = torch.randn(8, 16)
    res = plan_model((WithUnreadParameter(), (x,)), "localhost", gpus=4, batch=8, strategy=strategy)
    assert res.prediction.comm_bytes == dry_run(WithUnreadParameter(), strategy, (x,), world_size=4).our_bytes
