"""Models the project did not write train under every layout exactly as in one process, through the
public API with the user's own loop (issue: global semantics). Real gloo ranks."""

from __future__ import annotations

import importlib.util

import pytest

from hybridpar.train.launch import spawn

from . import _global_workers as W

STRATEGIES = ["sample=4", "sample=2,channel=2", "sample=2,filter=2", "channel=2,filter=2", "channel=4"]
TOL = 1e-4


def _check(result: dict) -> None:
    bad = []
    for name, per_strategy in result.items():
        for ranks in per_strategy:
            for rec in ranks:
                if "error" in rec or rec["err"] > TOL or rec["out_err"] > TOL:
                    bad.append((name, rec))
    assert not bad, bad


@pytest.mark.slow
def test_user_models_train_like_one_process_sgd():
    """Forwards that read x.shape / x.size(1) and reshape with them, a channel softmax,
    squeeze-excitation, a weight-free gate from a mean over channels, LocalResponseNorm, a
    ConvNeXt block (depthwise 7x7, channels-last LayerNorm, MLP, layer scale): all five layouts,
    4 SGD steps, cross-entropy. Every one must train correctly (none is refused)."""
    names = ["shape_reader", "channel_softmax", "squeeze_excite", "mean_gate", "lrn", "convnext_block"]
    _check(spawn(W.run_user_models, 4, names, STRATEGIES, "sgd", "ce"))


@pytest.mark.slow
def test_user_loop_adamw_and_own_loss():
    """Any optimizer and any loss: AdamW and a mean-squared error on one-hot targets."""
    _check(spawn(W.run_user_models, 4, ["squeeze_excite", "convnext_block"], STRATEGIES, "adamw", "mse"))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_hugging_face_vision_models():
    """Hugging Face transformers ResNet (its embedder checks the input's channel count) and ConvNeXt
    (channels-first LayerNorm written with means over dim 1), random init, offline."""
    _check(spawn(W.run_hf, 4, ["resnet", "convnext"], STRATEGIES))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_hugging_face_token_models():
    """Hugging Face GPT-2 and BERT classifiers on integer token ids (random init, offline): plain
    tensors the model builds (a causal mask, `torch.arange` indices for the last token's logits) meet
    channel-split activations, and DTensor, which refuses such a mix, treats them as replicated."""
    _check(spawn(W.run_hf, 4, ["gpt2", "bert"], STRATEGIES))
