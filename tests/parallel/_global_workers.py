"""Rank functions for the global-semantics tests: a model trained through the public API
(`hybridpar.parallelize`, the user's own loop, optimizer and loss) against the same loop in one
process. Importable by module name, so they survive process spawn."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hybridpar


def _max_err(full: dict, ref: dict) -> tuple[float, str]:
    return max(((float((full[k] - v).abs().max()) if v.numel() else 0.0), k)
               for k, v in ref.items() if v.is_floating_point())


def _loss(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "ce":
        return F.cross_entropy(out, y)
    return F.mse_loss(out, F.one_hot(y, out.shape[-1]).float())  # not cross-entropy


def train_pair(build, strategies: list[str], *, steps: int = 4, optimizer: str = "sgd", loss: str = "ce",
               lr: float = 0.05) -> list[dict]:
    """For each strategy: `steps` steps of the parallelized model and of the same model in one process
    on the same batches; the largest weight difference (every rank checks its full_state_dict).
    `build()` -> (module, x, y), seeded, the same on every rank."""
    rows = []
    for strategy in strategies:
        ref, x, y = build()
        model = copy.deepcopy(ref)
        rec = {"strategy": strategy}
        try:
            hybridpar.parallelize(model, strategy)
            make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9),
                    "adamw": lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.01)}[optimizer]
            opt, ref_opt = make(model.parameters()), make(ref.parameters())
            for _ in range(steps):
                _loss(loss, model(x), y).backward()
                opt.step()
                opt.zero_grad()
                _loss(loss, ref(x), y).backward()
                ref_opt.step()
                ref_opt.zero_grad()
            with torch.no_grad():
                model.eval()
                ref.eval()
                out_err = float((model(x) - ref(x)).abs().max())  # eval mode: running statistics
            err, where = _max_err(hybridpar.full_state_dict(model), ref.state_dict())
            rec.update(err=err, where=where, out_err=out_err)
        except Exception as e:  # reported, so the test names the failing strategy
            rec.update(error=f"{type(e).__name__}: {str(e)[:300]}")
        got = [None] * dist.get_world_size()
        dist.all_gather_object(got, rec)
        rows.append(got)
    return rows


def user_model(name: str):
    from .user_models import build

    return lambda: build(name)


def hf_model(kind: str):
    """A Hugging Face transformers vision model (random init, tiny config, offline)."""
    def build():
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers as tf

        torch.manual_seed(0)
        if kind in ("gpt2", "bert"):
            from .hf_token_models import build as token_model

            return token_model(kind)
        if kind == "resnet":
            cfg = tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10)
            net = tf.ResNetForImageClassification(cfg)
        else:
            cfg = tf.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10)
            net = tf.ConvNextForImageClassification(cfg)

        class Logits(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.net = net

            def forward(self, x):
                return self.net(pixel_values=x).logits

        x = torch.randn(4, 3, 32, 32)
        y = torch.randint(0, 10, (4,))
        return Logits(), x, y
    return build


def run_user_models(names: list[str], strategies: list[str], optimizer: str, loss: str) -> dict:
    return {name: train_pair(user_model(name), strategies, optimizer=optimizer, loss=loss) for name in names}


def run_hf(kinds: list[str], strategies: list[str]) -> dict:
    return {k: train_pair(hf_model(k), strategies, steps=2, lr=0.01) for k in kinds}
