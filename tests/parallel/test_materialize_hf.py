"""A Hugging Face model from a user's factory file is built piece by piece like any other: transformers
skips its weight init when it sees a meta-device context, so the record hides that context from its
probe (parallel/materialize.py); the example inputs re-batched by load_model run the same ops on meta
and on CPU. Before both, every HF model (and every factory whose example was re-batched) fell back to
the whole build on every rank."""

from __future__ import annotations

import functools

import pytest
import torch

from hybridpar.graph.models import load_model
from hybridpar.parallel.materialize import Materializer, record_build

pytest.importorskip("transformers")

FACTORY = '''
import torch
from torch import nn
from transformers import ResNetConfig, ResNetForImageClassification


class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        cfg = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5)
        self.m = ResNetForImageClassification(cfg)

    def forward(self, x):
        return self.m(pixel_values=x).logits


def model():
    return Wrapped(), torch.randn(2, 3, 16, 16)
'''


def test_hf_factory_replays_and_equals_the_whole_build(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "hf_model.py").write_text(FACTORY)
    spec = f"{tmp_path / 'hf_model.py'}:model"
    build = functools.partial(load_model, spec, batch=1, input_shape=(3, 8, 8))  # re-batched, reshaped
    meta, record, why = record_build(build)
    assert why is None and all(p.is_meta for p in meta.module.parameters())
    mat = Materializer(build, record, seed=5)
    mat(meta.module, None)
    assert not mat.notes, mat.notes  # no fallback to the whole build
    torch.manual_seed(5)
    ref = build().module.state_dict()
    got = meta.module.state_dict()
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    # HF's own init ran in both (its kaiming_normal_ conv init, not nn.Conv2d's kaiming_uniform_ bound)
    w = got["m.resnet.embedder.embedder.convolution.weight"]
    assert w.abs().max() > (1 / (3 * 7 * 7)) ** 0.5
