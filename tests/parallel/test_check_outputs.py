"""The dry run (hybridpar.check) takes any output structure: an unwrapped Hugging Face model's
ModelOutput, nested tuples and dicts, dataclasses; a model with nothing to run backward from is
refused naming that cause (issue 33, newcomer item 1)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import hybridpar
from hybridpar.errors import UserError


class Nested(nn.Module):
    """Outputs the logits inside a dict inside a tuple, with a non-tensor and an integer tensor around."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        logits = self.head(h.mean(dim=(2, 3)))
        return (logits.argmax(dim=1), {"feats": h, "out": (None, logits)}, "note")


@dataclass
class Out:
    extra: int
    logits: torch.Tensor


class DataclassOut(Nested):
    def forward(self, x):
        return Out(3, super().forward(x)[1]["out"][1])


class NoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return {"classes": self.lin(x).argmax(dim=1)}


@pytest.mark.parametrize("strategy", ["sample=2", "channel=2"])
def test_hf_model_output_passes_check(strategy):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tf = pytest.importorskip("transformers")  # a third-party package, not ours
    torch.manual_seed(0)
    cfg = tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10)
    model = tf.ResNetForImageClassification(cfg)  # unwrapped: returns an ImageClassifierOutputWithNoAttention
    x = torch.randn(4, 3, 32, 32)
    run = hybridpar.check(model, strategy, x, world_size=2)
    assert run.output_shapes == [(4, 10)]
    run = hybridpar.check(model, strategy, x, torch.randint(0, 10, (4,)), world_size=2)  # loss on the logits
    assert run.output_shapes == [(4, 10)]


@pytest.mark.parametrize("model_cls", [Nested, DataclassOut])
@pytest.mark.parametrize("strategy", ["sample=2", "channel=2"])
def test_nested_outputs_pass_check(model_cls, strategy):
    torch.manual_seed(0)
    run = hybridpar.check(model_cls(), strategy, torch.randn(4, 4, 6, 6), world_size=2)
    shapes = {Nested: [(4,), (4, 8, 6, 6), (4, 5)], DataclassOut: [(4, 5)]}[model_cls]
    assert run.output_shapes == shapes
    if strategy == "channel=2":  # the channel layout's collectives were recorded: the backward ran through it
        assert run.total_bytes


def test_output_without_gradient_names_the_cause():
    with pytest.raises(UserError, match=r"output \(dict\) holds no floating-point tensor") as err:
        hybridpar.check(NoGrad(), "sample=2", torch.randn(4, 4), world_size=2)
    assert "backward'" not in str(err.value) and "sample-only" not in str(err.value)
