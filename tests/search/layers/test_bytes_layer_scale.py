"""A per-channel parameter of an elementwise op on a channel-split activation (a layer scale,
ConvNeXt-V2's GRN, Dinov2's LayerScale) gets its gradient split on channel_filter as the activation
is (DTensor: Shard), and the runtime sums only this rank's piece over the sample groups. The planner
priced the whole parameter (HF convnextv2 tiny, sample=2,filter=2, batch 4: 5,888 allreduce bytes
over; convnext 736, swiftformer 2,616, dinov2/beit 768)."""

from __future__ import annotations

import pytest
import torch
from torch import nn


class Scaled(nn.Module):
    """A conv's output times a (C, 1, 1) scale, a linear's tokens times an (E,) scale."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 10, 3, padding=1)
        self.scale = nn.Parameter(torch.ones(10, 1, 1))
        self.fc = nn.Linear(10, 6)
        self.gamma = nn.Parameter(torch.ones(6))
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        t = (self.conv(x) * self.scale).flatten(2).transpose(1, 2)  # (N, HW, C), split on C
        return self.head(self.fc(t) * self.gamma).mean(1)


@pytest.mark.parametrize("strategy", ["sample=2,filter=2", "sample=2,channel=2", "sample=4"])
def test_planned_bytes_equal_the_runtimes(strategy):
    from hybridpar.parallel.check import dry_run
    from hybridpar.search.layers.planner import plan_model

    x = torch.randn(8, 3, 4, 4)
    res = plan_model((Scaled(), (x,)), "localhost", gpus=4, batch=8, strategy=strategy)
    assert res.prediction.comm_bytes == dry_run(Scaled(), strategy, (x,), world_size=4).our_bytes
    assert sum(g.allreduce_bytes for g in res.gradients) == res.breakdown.grad_bytes
