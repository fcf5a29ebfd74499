"""A concatenation along channels of channel-split activations: the runtime moves the parts of each
rank's piece that other ranks hold in one all-to-all in the sample group, forward and backward
(parallel/styles/concat.py; cost.layout_comm.channel_concat). The planner priced joins without any
communication: the zoo-less models below sent all-to-all bytes that `hybridpar plan` never showed
(HF hgnet_v2, 4 ranks, sample=2,filter=2, batch 4: 282,624 bytes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn


class Branches(nn.Module):
    """Two convolutions of unequal widths side by side, concatenated, then a 1x1 conv."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a = nn.Conv2d(8, 6, 3, padding=1)
        self.b = nn.Conv2d(8, 10, 1)
        self.out = nn.Conv2d(16, 4, 1)

    def forward(self, x):
        x = self.stem(x)
        return self.out(torch.cat([self.a(x), self.b(x)], 1)).mean((2, 3))


def factory():
    return Branches(), (torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0)),)


@pytest.mark.parametrize("strategy,moves", [("sample=2,filter=2", True), ("channel=2", True),
                                             ("channel=4", False)])
def test_planned_bytes_equal_the_runtimes(strategy, moves):
    """channel=4: the 6-channel branch has an empty fourth piece, so its conv's output is gathered
    whole (runtime.dtensors.settle) and DTensor, not the all-to-all, runs the concatenation."""
    from hybridpar.parallel.check import dry_run
    from hybridpar.search.layers.planner import plan_model

    gpus = 2 if strategy == "channel=2" else 4
    res = plan_model(factory(), "localhost", gpus=gpus, batch=8, strategy=strategy)
    model, inputs = factory()
    sent = dry_run(model, strategy, inputs, world_size=gpus).our_bytes
    assert ("alltoall" in sent) == moves
    assert res.prediction.comm_bytes == sent
    (join,) = [r for r in res.layers if r.layout is None]
    assert (join.cost.comm_fwd_s > 0 and join.cost.comm_bwd_s > 0) == moves  # priced in time too
