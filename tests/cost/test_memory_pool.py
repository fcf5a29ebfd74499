"""The activations `predict_rank_memory` (so `hybridpar plan`) and the placer's `training_memory`
count are the storages autograd saves for backward (torch 2.13 CPU, `saved_tensors_hooks`, distinct
storages less parameters, buffers and the inputs), layer kind by layer kind: a max-pool's int64
indices (the per-layer figure left them out: small_cnn 9% and inception_mini 27% under), an adaptive
max-pool's too, nothing for a global average pool or an upsample, a sigmoid's/tanh's output rather
than its input, a layer/group/RMS norm's per-row statistics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from autograd_saved import saved_bytes
from torch import nn

from hybridpar.cost.memory import predict_rank_memory, training_memory
from hybridpar.graph.models import load_model
from hybridpar.graph.tracing import trace

BATCH = 4


def _predicted(model: nn.Module, inputs: tuple) -> tuple[float, float]:
    """(predict_rank_memory's activations, training_memory's less the graph inputs)."""
    g = trace(model, inputs)
    per_layer = predict_rank_memory(g, "sample=1", batch=BATCH, framework_bytes=0).activations_bytes
    whole = training_memory(g, optimizer="sgd").activations_bytes - sum(4 * x.numel() for x in inputs)
    return per_layer, whole


@pytest.mark.parametrize("name", ["small_cnn", "inception_mini"])
def test_zoo_pooling_models_count_what_autograd_saves(name):
    """Both keep max-pool indices (inception_mini's 3x3 stride-1 pool branches: as many as the
    pool's outputs, at 8 bytes each) and end in a global average pool, which keeps nothing."""
    torch.manual_seed(0)
    m = load_model(name, batch=BATCH)
    real = saved_bytes(m.module, m.example_inputs)
    per_layer, whole = _predicted(m.module, m.example_inputs)
    assert per_layer == pytest.approx(real, rel=0.005)  # batch norm's per-channel statistics left out
    assert whole == pytest.approx(real, rel=0.005)


class _Between(nn.Module):
    """conv -> op -> conv: the op's input is a fresh output and its output is kept by the next conv,
    so the op's own rule decides what the prediction says about the first conv's output."""

    def __init__(self, op: nn.Module, c_out: int = 8):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.op = op
        self.c2 = nn.Conv2d(c_out, 4, 1)

    def forward(self, x):
        return self.c2(self.op(self.c1(x)))


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


OPS = {
    "maxpool": nn.MaxPool2d(2),
    "maxpool_k3s1": nn.MaxPool2d(3, 1, 1),
    "adaptive_max": nn.AdaptiveMaxPool2d(3),
    "adaptive_max_global": nn.AdaptiveMaxPool2d(1),
    "adaptive_avg": nn.AdaptiveAvgPool2d(3),
    "adaptive_avg_global": nn.AdaptiveAvgPool2d(1),
    "upsample_nearest": nn.Upsample(scale_factor=2),
    "interpolate_bilinear": _Fn(lambda x: F.interpolate(x, scale_factor=2, mode="bilinear")),
    "interpolate_area": _Fn(lambda x: F.interpolate(x, size=(5, 5), mode="area")),
    "gelu": nn.GELU(),
    "silu": nn.SiLU(),
    "sigmoid": nn.Sigmoid(),
    "tanh": _Fn(torch.tanh),
    "scale": _Fn(lambda x: x * 0.5),
    "groupnorm": nn.GroupNorm(2, 8),
    "layernorm_fn": _Fn(lambda x: F.layer_norm(x, (12, 12))),
}


@pytest.mark.parametrize("op", list(OPS))
def test_layer_kind_counts_what_autograd_saves(op):
    torch.manual_seed(0)
    model, inputs = _Between(OPS[op]), (torch.randn(BATCH, 3, 12, 12),)
    real = saved_bytes(model, inputs)
    per_layer, whole = _predicted(model, inputs)
    assert per_layer == pytest.approx(real, rel=1e-3)
    assert whole == pytest.approx(real, rel=1e-3)


class _Tokens(nn.Module):
    """An embedding, a layer norm over the features and an RMS norm: the norms keep their input and
    per-row statistics (mean and 1/std; RMS: 1/rms and, with a weight, the normalised input)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.norm = norm
        self.fc = nn.Linear(16, 4)

    def forward(self, t):
        return self.fc(torch.tanh(self.norm(self.embed(t))))


@pytest.mark.parametrize("norm", [nn.LayerNorm(16), nn.RMSNorm(16), nn.RMSNorm(16, elementwise_affine=False)],
                         ids=["layernorm", "rmsnorm", "rmsnorm-noweight"])
def test_norm_statistics_counted(norm):
    torch.manual_seed(0)
    model, inputs = _Tokens(norm), (torch.randint(0, 20, (BATCH, 6)),)
    real = saved_bytes(model, inputs)
    per_layer, _ = _predicted(model, inputs)
    assert per_layer == pytest.approx(real, rel=1e-3)
