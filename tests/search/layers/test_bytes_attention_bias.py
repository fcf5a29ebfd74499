"""LeViT's attention biases: a parameter [heads, points] indexed into [heads, N, N] (biases[:, idx])
and added to the attention scores [B, heads, N, N]. Under a channel/filter layout the scores are split
on heads (from the split query/key projection), so DTensor leaves the biases' gradient split on heads
and the runtime sums only this rank's piece over the sample groups. The planner priced it whole (HF
levit tiny, 4 ranks, sample=2,filter=2, batch 4: 120 B of the gradient allreduce over)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

HEADS, SIDE = 4, 3  # 3 x 3 tokens


class BiasedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.scores = nn.Linear(6, HEADS * SIDE * SIDE)  # stands for q @ k^T: split on heads as that is
        points = list(itertools.product(range(SIDE), range(SIDE)))
        offsets, idxs = {}, []
        for p1 in points:
            for p2 in points:
                off = (abs(p1[0] - p2[0]), abs(p1[1] - p2[1]))
                idxs.append(offsets.setdefault(off, len(offsets)))
        self.biases = nn.Parameter(torch.randn(HEADS, len(offsets)))
        self.register_buffer("idx", torch.tensor(idxs).view(SIDE * SIDE, SIDE * SIDE), persistent=False)
        self.head = nn.Linear(HEADS, 3)

    def forward(self, x):  # x: [B, N, 6]
        b, n, _ = x.shape  # (a 4-D matmul costs DTensor's sharding propagation ~10 s here)
        scores = self.scores(x).view(b, n, HEADS, n).transpose(1, 2) + self.biases[:, self.idx]  # [B, heads, N, N]
        return self.head(scores.sum(-1).transpose(1, 2).mean(1))


def factory():
    return BiasedAttention(), (torch.randn(8, SIDE * SIDE, 6, generator=torch.Generator().manual_seed(0)),)


@pytest.mark.parametrize("strategy", ["sample=2,filter=2", "sample=2,channel=2"])
def test_planned_bytes_equal_the_runtimes(strategy):
    from hybridpar.parallel.check import dry_run
    from hybridpar.search.layers.planner import plan_model

    res = plan_model(factory(), "localhost", gpus=4, batch=8, strategy=strategy)
    model, inputs = factory()
    assert res.prediction.comm_bytes == dry_run(model, strategy, inputs, world_size=4).our_bytes
