"""The gradient of a whole conv's output (a grouped/depthwise conv the runtime runs whole on every rank
under a channel/filter layout) is gathered by DTensor where the whole tensor meets a split one, at
the size it has there (cost.layout_comm.whole_grad_gather): a split layer or batch norm slices it
(its backward gathers the slice's input: the conv's output, or the [N, C] mean before a linear); an
elementwise join with a split operand (a residual add) keeps the gradient split back to the conv,
whose backward gathers it at its output (through a pooling or a mean too). The search priced none
of it (`hybridpar plan --strategy` added the dry run's record): on an uncalibrated localhost it
chose sample=2,filter=2 for a tiny HF MobileNetV2 at batch 8 on 4 ranks (predicted 1.085x DP),
which measured 0.43x DP. Sent bytes: the dry run's total (one rank of `hybridpar train`)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn


class Consumers(nn.Module):
    """A stem, a depthwise conv (whole under channel/filter layouts) and one consumer of its output."""

    def __init__(self, consumer: str = "mean_linear"):
        super().__init__()
        self.consumer = consumer
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.bn = nn.BatchNorm2d(16) if consumer == "batchnorm" else None
        self.pw = nn.Conv2d(16, 16, 1) if consumer in ("batchnorm", "two_convs") else None
        self.pw2 = nn.Conv2d(16, 16, 1) if consumer == "two_convs" else None
        self.head = None if consumer == "mean_out" else nn.Linear(16, 10)

    def forward(self, x):
        s = self.stem(x)
        d = self.dw(s)
        if self.consumer == "mean_linear":  # gathered after the mean: [N, C]
            y = d.mean((2, 3))
        elif self.consumer == "batchnorm":  # the batch norm slices the conv's output
            y = self.pw(torch.relu(self.bn(d))).mean((2, 3))
        elif self.consumer == "two_convs":  # two slices, two gathers
            y = (self.pw(d) + self.pw2(d)).mean((2, 3))
        elif self.consumer == "pool_add":  # split through the pooling: gathered at the conv's output
            y = (F.max_pool2d(torch.relu(d), 2) + F.max_pool2d(s, 2)).mean((2, 3))
        elif self.consumer == "mean_add":  # split through the mean, gathered at the conv's output
            y = d.mean((2, 3)) + s.mean((2, 3))
        else:  # "mean_out": the model's output, whole: neither gathered forward nor backward
            return d.mean((2, 3))
        return self.head(y)


def factory(consumer: str = "mean_linear", batch: int = 8):
    return Consumers(consumer), (torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(0)),)


PIECE = 4 * 16 * 8 * 8 * 4  # the dw conv's output for a sample group's 4 samples, fp32
GATHERED = {"mean_linear": [4 * 16 * 4], "batchnorm": [PIECE], "two_convs": [PIECE, PIECE],
            "pool_add": [PIECE], "mean_add": [PIECE], "mean_out": []}


def _planned_and_sent(make, strategy: str, batch: int = 8):
    from hybridpar.parallel.check import dry_run
    from hybridpar.search.layers.planner import plan_model

    res = plan_model(make(), "localhost", gpus=4, batch=batch, strategy=strategy)
    model, inputs = make()
    return res, dry_run(model, strategy, inputs, world_size=4)


@pytest.mark.parametrize("consumer", sorted(GATHERED))
def test_the_gather_follows_the_consumer(consumer):
    res, run = _planned_and_sent(lambda: factory(consumer), "sample=2,filter=2")
    assert res.prediction.comm_bytes == run.total_bytes
    moves = sorted(m for row in res.layers for m in row.cost.dtensor_moves)
    assert moves == sorted(("allgather", 2, b) for b in GATHERED[consumer])


@pytest.mark.parametrize("strategy", ["channel=4", "channel=2,filter=2"])
def test_the_separable_cnn_at_other_layouts(strategy):
    """The separable CNN of test_bytes_grouped_conv: dw's output meets a residual add, grp's a mean
    and a linear (its test checks sample=2,filter=2 and channel=2,filter=2)."""
    from tests.search.layers.test_bytes_grouped_conv import factory as separable

    res, run = _planned_and_sent(separable, strategy)
    assert res.prediction.comm_bytes == run.total_bytes


def test_plan_strategy_adds_no_priced_gather_again(tmp_path, monkeypatch, capsys):
    """`hybridpar plan --strategy` adds the dry run's DTensor moves the plan does not price: none
    here (before: the gather of the mean's gradient, as a note and in the bytes)."""
    from hybridpar.cli.main import main
    from hybridpar.parallel.check import dry_run

    monkeypatch.setenv("HYBRIDPAR_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "consumers.py"
    path.write_text(Path(__file__).read_text())
    args = ["plan", "--model", f"{path}:factory", "--strategy", "sample=2,filter=2", "--gpus", "4",
            "--batch", "8", "--json"]
    assert main(args) == 0
    planned = json.loads(capsys.readouterr().out)
    assert not [n for n in planned["plan"]["notes"] if n.startswith("dry run:")]
    model, inputs = factory()
    sent = dry_run(model, "sample=2,filter=2", inputs, world_size=4).total_bytes
    assert {k: v for k, v in planned["predicted"]["comm_bytes"].items() if v} == sent


def _mobilenet_v2():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.m = MobileNetV2ForImageClassification(MobileNetV2Config(
                depth_multiplier=0.25, min_depth=8, image_size=16, num_labels=10))

        def forward(self, x):
            return self.m(pixel_values=x).logits

    return Logits(), (torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0)),)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
@pytest.mark.parametrize("strategy", ["sample=2,filter=2", "channel=4"])
def test_hf_mobilenet_v2(strategy):
    """Each inverted residual's depthwise conv feeds a batch norm (HF MobileNetV2, random init, tiny
    widths, 16x16): before, 67,328 / 134,656 of 937,424 / 1,944,192 allgather bytes sent the search
    left out (sample=2,filter=2 / channel=4)."""
    res, run = _planned_and_sent(_mobilenet_v2, strategy)
    assert res.prediction.comm_bytes == run.total_bytes


class NormOnABranch(nn.Module):
    """A LayerNorm on one branch of a split layer's output (CLIP's pooled post-LayerNorm, unused by
    its classifier) and a mean on another, which the head reads: the mean is split, not whole."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.body(x))
        self.pooled = self.norm(h[:, 0])
        return self.head(h[:, 1:].mean(1))


def test_whole_follows_the_inputs_not_the_order():
    """Before: every node after the norm in the layer's followers was taken as whole (HF CLIP's
    classifier: 1,536 allgather bytes planned that were not sent, sample=2,filter=2, batch 4)."""
    x = torch.randn(8, 5, 16)
    res, run = _planned_and_sent(lambda: (NormOnABranch(), (x,)), "sample=2,filter=2")
    assert res.prediction.comm_bytes == run.total_bytes


class ShapeRead(nn.Module):
    """A LayerNorm's whole output reshaped to the patch conv's height and width (the tracer lists the
    patch conv's output among the reshape's inputs), then a mean and a linear (HF PVTv2's last stage)."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 16, 2, stride=2)
        self.dense = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        p = self.patch(x)
        n, _, h, w = p.shape
        t = self.norm(self.dense(p.flatten(2).transpose(1, 2)))
        return self.head(t.reshape(n, h, w, 32).mean((1, 2)))


def test_a_shape_read_is_not_an_operand():
    """Before: the reshape counted the patch conv's split output as an operand, so its result and
    the mean were not whole and the head's input gradient gather went unpriced (HF pvt_v2 tiny:
    512 allgather bytes, sample=2,filter=2, batch 4)."""
    x = torch.randn(8, 3, 8, 8)
    res, run = _planned_and_sent(lambda: (ShapeRead(), (x,)), "sample=2,filter=2")
    assert res.prediction.comm_bytes == run.total_bytes
