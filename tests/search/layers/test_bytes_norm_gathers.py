"""A layer or RMS norm whose input arrives split on channel_filter: DTensor gathers the input (over
the G ranks of a sample group) because the norm's statistics span the split features. A layer norm
(torch's native_layer_norm strategy) gathers it forward and again backward, autograd having saved
the split input; an RMS norm, whose decomposition DTensor refuses on a split input, runs on the input
gathered once by hybridpar.parallel.styles.concat (its backward a slice). The planner priced neither
(cost.layout_comm.norm_gathers now): e.g. SegFormer's MixFFN shape, sample=2,filter=2: 44,192
allgather bytes planned, 52,384 sent. Sent: the dry run's total (one rank of `hybridpar train`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn


class Tokens(nn.Module):
    """A linear split on features, the norm, a linear (it slices the whole output), a mean."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(16, 32), norm, nn.Linear(32, 4)

    def forward(self, x):
        return self.b(self.norm(self.a(x))).mean(1)


class Residual(nn.Module):
    """The norm after a residual add of two split linears (a join, then the norm)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.a, self.c, self.norm, self.b = nn.Linear(16, 32), nn.Linear(32, 32), norm, nn.Linear(32, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(self.norm(h + self.c(torch.relu(h)))).mean(1)


class ChannelsLast(nn.Module):
    """ConvNeXt's channels-last LayerNorm: a conv split on channels, permuted, normalised."""

    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Conv2d(3, 16, 3, padding=1), nn.LayerNorm(16), nn.Conv2d(16, 8, 1)

    def forward(self, x):
        h = self.norm(self.a(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.b(torch.relu(h)).mean((2, 3))


TOKENS = torch.randn(8, 5, 16, generator=torch.Generator().manual_seed(0))
IMAGES = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0))
CASES = {
    "layer_norm": (lambda: Tokens(nn.LayerNorm(32)), TOKENS),
    "layer_norm_no_affine": (lambda: Tokens(nn.LayerNorm(32, elementwise_affine=False)), TOKENS),
    "rms_norm": (lambda: Tokens(nn.RMSNorm(32)), TOKENS),
    "residual_layer_norm": (lambda: Residual(nn.LayerNorm(32)), TOKENS),
    "residual_rms_norm": (lambda: Residual(nn.RMSNorm(32)), TOKENS),
    "channels_last": (ChannelsLast, IMAGES),
}


def _planned_and_sent(case: str, strategy: str):
    from hybridpar.parallel.check import dry_run
    from hybridpar.search.layers.planner import plan_model

    make, x = CASES[case]
    torch.manual_seed(0)
    res = plan_model((make(), (x,)), "localhost", gpus=4, batch=8, strategy=strategy)
    return res, dry_run(make(), strategy, (x,), world_size=4)


@pytest.mark.parametrize("strategy", ["sample=2,filter=2", "channel=4"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_planned_bytes_equal_the_runtimes(case, strategy):
    res, run = _planned_and_sent(case, strategy)
    assert res.prediction.comm_bytes == run.total_bytes
    norm = [(r["kind"], r["group_size"], r["bytes"]) for r in run.dtensor if r["module"] == "norm"]
    assert len(norm) == (1 if "rms" in case else 2)  # what the docstring says the runtime does
    moves = [m for row in res.layers for m in row.cost.dtensor_moves]
    assert all(moves.count(m) >= norm.count(m) for m in norm)  # listed, so `hybridpar plan` adds none


def test_bytes_are_the_sample_groups_input():
    """sample=2,filter=2: 4 samples x 5 tokens x 32 features x 4 bytes, gathered over 2 ranks."""
    res, run = _planned_and_sent("layer_norm", "sample=2,filter=2")
    assert [(r["kind"], r["group_size"], r["bytes"]) for r in run.dtensor if r["module"] == "norm"] \
        == [("allgather", 2, 4 * 5 * 32 * 4)] * 2


def test_plan_adds_no_norm_gather_again():
    """api.plan adds the dry run's DTensor records the plan does not list: none here."""
    from hybridpar.api import _not_in_plan

    for case in ("layer_norm", "rms_norm", "residual_layer_norm"):
        res, run = _planned_and_sent(case, "sample=2,filter=2")
        records = [r for r in run.dtensor if r["group_size"] > 1 and not r.get("priced")]
        assert records and _not_in_plan(records, res) == [], case


class AfterDepthwise(nn.Module):
    """A channels-last LayerNorm after a depthwise conv, which the runtime runs whole."""

    def __init__(self):
        super().__init__()
        self.a, self.dw = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.norm, self.b = nn.LayerNorm(16), nn.Conv2d(16, 8, 1)

    def forward(self, x):
        h = self.norm(self.dw(self.a(x)).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.b(h).mean((2, 3))


def test_a_norm_on_a_whole_input_gathers_nothing():
    from hybridpar.parallel.check import dry_run
    from hybridpar.search.layers.planner import plan_model

    res = plan_model((AfterDepthwise(), (IMAGES,)), "localhost", gpus=4, batch=8, strategy="sample=2,filter=2")
    run = dry_run(AfterDepthwise(), "sample=2,filter=2", (IMAGES,), world_size=4)
    assert not [r for r in run.dtensor if r["module"] == "norm"]
    assert res.prediction.comm_bytes == run.total_bytes
