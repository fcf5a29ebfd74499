"""Grouped/depthwise convolutions (groups > 1) under a channel/filter layout: the runtime leaves
them whole (parallel/styles/table.py: only an exact nn.Conv2d with groups == 1 and zeros padding is
distributed; DTensor runs the rest replicated over channel_filter, hybridpar.parallel.dtensor.rules),
so the planner prices them whole: no channel/filter collectives, whole compute and memory, their
gradient replicated and summed over the sample groups. Before, a plan of any channel/filter layout
for a model with one was refused ("grouped/depthwise layer: sample split only") although the
runtime runs it. The runtime's bytes are read from the dry run (one rank of `hybridpar train`):
`total_bytes`, every byte sent, DTensor's gathers around the whole convs included."""

from __future__ import annotations

import pytest
import torch
from torch import nn


class Separable(nn.Module):
    """Stem, depthwise 3x3 + pointwise 1x1 with a residual add, a grouped conv, pool, head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.pw = nn.Conv2d(16, 16, 1)
        self.grp = nn.Conv2d(16, 32, 3, padding=1, groups=4)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.bn(self.stem(x)))
        x = x + self.dw(x)
        x = torch.relu(self.pw(x))
        return self.head(self.grp(x).mean((2, 3)))


def factory():
    return Separable(), (torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0)),)


def test_the_shared_rule():
    from hybridpar.cost.layout_comm import splits_by_layout
    from hybridpar.graph import trace
    from hybridpar.parallel.styles.table import splits_as_conv

    model, inputs = factory()
    convs = {n.module: splits_by_layout(n) for n in trace(model, inputs).nodes if n.op == "conv2d"}
    assert convs == {"stem": True, "dw": False, "pw": True, "grp": False}
    assert convs == {name: splits_as_conv(m) for name, m in model.named_modules() if isinstance(m, nn.Conv2d)}


@pytest.mark.parametrize("strategy", ["sample=2,filter=2", "channel=2,filter=2"])
def test_planned_bytes_equal_the_runtimes(strategy):
    from hybridpar.parallel.check import dry_run
    from hybridpar.search.layers.planner import plan_model

    res = plan_model(factory(), "localhost", gpus=4, batch=8, strategy=strategy)
    model, inputs = factory()
    assert res.prediction.comm_bytes == dry_run(model, strategy, inputs, world_size=4).total_bytes
    listed = {g.module: g.layout for g in res.gradients if g.op == "conv2d"}
    assert listed["dw"] == listed["grp"] == "whole"
    assert "dw" not in res.plan.layers and "grp" not in res.plan.layers  # the runtime refuses a layout for them
    algorithm = {r.module: r.algorithm for r in res.layers}
    assert algorithm["dw"] == algorithm["grp"] == "whole"


def test_another_padding_mode_runs_whole():
    from hybridpar.cost.layout_comm import splits_by_layout
    from hybridpar.graph import trace

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect"), nn.Conv2d(8, 8, 3, padding=1))
    convs = [splits_by_layout(n) for n in trace(model, (torch.randn(2, 3, 8, 8),)).nodes if n.op == "conv2d"]
    assert convs == [False, True]


def test_the_gathers_around_a_whole_conv_are_logged():
    """DTensor gathers a whole conv's channel-split input (forward, and again in backward) and its
    output's gradient on channel_filter inside our convolution handler (dtensor_rules), where the
    recorder of DTensor's collectives was off the mode stack: `hybridpar train --json` and the plan's
    dry run left them out (sample=2,filter=2: 20,640 allgather bytes logged, 102,560 sent)."""
    from hybridpar.parallel.check import dry_run

    model, inputs = factory()
    run = dry_run(model, "sample=2,filter=2", inputs, world_size=4)
    piece = 4 * 16 * 8 * 8 * 4  # a sample group's 4 samples, 16 channels, 8x8, fp32
    # dw: x forward, x and dy backward; grp: x forward and backward (its dy arrives whole)
    assert [r["bytes"] for r in run.dtensor if r["kind"] == "allgather"].count(piece) == 5


class TwoBranches(nn.Module):
    """Two convolutions of the same input joined by a concatenation, then a 1x1 conv."""

    def __init__(self, groups: int):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.a = nn.Conv2d(16, 16, 3, padding=1, groups=groups)
        self.b = nn.Conv2d(16, 16, 3, padding=1, groups=groups)
        self.out = nn.Conv2d(32, 8, 1)

    def forward(self, x):
        x = self.stem(x)
        return self.out(torch.cat([self.a(x), self.b(x)], 1)).mean((2, 3))


def test_a_join_of_whole_layers_is_priced_whole():
    """Both inputs whole on channel_filter (DTensor: Replicate), so the concatenation runs whole on
    every rank of a sample group: twice the compute of the concatenation of split inputs at G = 2."""
    from hybridpar.search.layers.planner import plan_model

    def join(groups: int):
        model = TwoBranches(groups)
        res = plan_model((model, (torch.randn(8, 3, 16, 16),)), "localhost", gpus=4, batch=8,
                         strategy="sample=2,filter=2")
        (row,) = [r for r in res.layers if r.layout is None]
        return row.cost.fwd_s + row.cost.bwd_s

    assert join(16) == pytest.approx(2 * join(1), rel=0.05)


def test_the_planner_prices_the_input_gathers():
    """The two gathers of a whole conv's split input (forward, and backward for its weight gradient)
    are the planner's (cost.layout_comm.whole_conv_gathers): in the plan's bytes and time, so the
    dry run does not add them again. So are the gathers of the whole outputs' gradients where they
    meet split ones (cost.layout_comm.whole_grad_gather): dw's at its output (a residual add), grp's
    after the mean (the head's input). Plan = every byte one rank of `hybridpar train` logs (102,560
    allgather bytes here)."""
    from hybridpar.parallel.check import dry_run
    from hybridpar.search.layers.planner import plan_model

    res = plan_model(factory(), "localhost", gpus=4, batch=8, strategy="sample=2,filter=2")
    model, inputs = factory()
    run = dry_run(model, "sample=2,filter=2", inputs, world_size=4)
    assert res.prediction.comm_bytes["allgather"] == run.total_bytes["allgather"] == 102_560
    piece = 4 * 16 * 8 * 8 * 4
    # dw (input from the stem's batch norm: split) and grp (input from pw: split), twice each; dw's
    # output gradient; the head's input gradient (4 samples x 32 channels)
    assert res.prediction.comm_bytes["allgather"] - 20_128 == 4 * piece + piece + 4 * 32 * 4
    rows = {r.module: r for r in res.layers}
    assert rows["dw"].cost.comm_fwd_s > 0 and rows["dw"].cost.comm_bwd_s > 0


class MixFFN(nn.Module):
    """SegFormer/PVTv2's feed-forward: a patch conv, a LayerNorm over the tokens' features, a linear,
    the tokens viewed as an image (height and width read from the patch conv's output) for a
    depthwise conv, and a linear back."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 16, 2, stride=2)
        self.norm = nn.LayerNorm(16)
        self.dense1 = nn.Linear(16, 32)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.dense2 = nn.Linear(32, 10)

    def forward(self, x):
        p = self.patch(x)
        n, _, h, w = p.shape
        t = self.dense1(self.norm(p.flatten(2).transpose(1, 2)))
        t = self.dw(t.transpose(1, 2).reshape(n, 32, h, w)).flatten(2).transpose(1, 2)
        return self.dense2(t).mean(1)


def test_a_depthwise_conv_on_a_linears_tokens():
    """Its input is the linear's output, split on features (the tracer also lists the patch conv's
    output among the conv's inputs, for the shape it read: whole after the LayerNorm); the settle
    rule reads a linear's features, not its dim 1 (HF segformer and pvt_v2 tiny: 4,096 and 180,224
    allgather bytes the plan left out)."""
    from hybridpar.parallel.check import dry_run
    from hybridpar.search.layers.planner import plan_model

    x = torch.randn(8, 3, 8, 8)
    res = plan_model((MixFFN(), (x,)), "localhost", gpus=4, batch=8, strategy="sample=2,filter=2")
    run = dry_run(MixFFN(), "sample=2,filter=2", (x,), world_size=4)
    assert any(r.get("priced") for r in run.dtensor)  # the depthwise conv's input was gathered
    assert res.prediction.comm_bytes == run.total_bytes
