"""Measure epochs-to-target vs batch size by really training a small task (sklearn's bundled digits).

Learning-rate rule (documented in docs/convergence.md): linear scaling, lr = base_lr * B / base_batch
(Goyal et al. 2017), capped at max_lr, with a linear warm-up over the first `warmup_epochs` epochs;
SGD with momentum. Accuracy is measured on a fixed held-out split `evals_per_epoch` times per epoch, and
the epoch count at the first evaluation that meets the target is recorded (fractional epochs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
from torch import nn

from hybridpar.convergence.curve import McCandlishCurve, TableCurve
from hybridpar.convergence.fit import fit_mccandlish
from hybridpar.errors import UserError

DATASETS = ("digits",)


@dataclass(frozen=True)
class LRRule:
    base_lr: float = 0.05
    base_batch: int = 32
    max_lr: float = 0.8
    warmup_epochs: float = 1.0
    momentum: float = 0.9

    def peak_lr(self, batch: int) -> float:
        return min(self.base_lr * batch / self.base_batch, self.max_lr)

    def lr(self, batch: int, epoch: float) -> float:
        warm = min(1.0, (epoch + 1e-9) / self.warmup_epochs) if self.warmup_epochs > 0 else 1.0
        return self.peak_lr(batch) * warm


@dataclass(frozen=True)
class RunResult:
    batch: int
    seed: int
    epochs_to_target: float | None  # None: target not reached within max_epochs
    steps: int
    best_accuracy: float


@dataclass(frozen=True)
class Measurement:
    model: str
    data: str
    target: float
    samples_per_epoch: int
    rule: LRRule
    runs: tuple[RunResult, ...]
    curve: McCandlishCurve | None
    table: TableCurve | None

    def per_batch(self) -> list[dict]:
        """Mean and spread of epochs-to-target over the seeds that reached it, per batch size."""
        out = []
        for b in sorted({r.batch for r in self.runs}):
            rs = [r for r in self.runs if r.batch == b]
            ok = [r.epochs_to_target for r in rs if r.epochs_to_target is not None]
            out.append({"batch": b, "epochs_mean": float(np.mean(ok)) if ok else None,
                            "epochs_sd": float(np.std(ok, ddof=1)) if len(ok) > 1 else 0.0,
                            "reached": len(ok), "seeds": len(rs), "lr_peak": self.rule.peak_lr(b)})
        return out


@cache
def digits_split(test_frac: float = 0.2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """sklearn's bundled 8x8 digits (1,797 images), a fixed stratified held-out split, pixels in [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_frac, random_state=0, stratify=y)

    def as_img(a) -> torch.Tensor:
        return torch.tensor(a, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0

    return as_img(xtr), torch.tensor(ytr), as_img(xte), torch.tensor(yte)


def build_model(name: str, seed: int) -> nn.Module:
    """A zoo model sized for 1x8x8 inputs and 10 classes."""
    from hybridpar.graph.zoo import ZOO

    entry = ZOO.get(name)
    if entry is None:
        raise UserError(f"unknown model {name!r}; known: {', '.join(sorted(ZOO))}")
    torch.manual_seed(seed)
    try:
        net = entry.build(in_channels=1, num_classes=10)
        net(torch.zeros(2, 1, 8, 8))
    except Exception as err:  # any zoo model that cannot take 1x8x8 digits
        raise UserError(f"model {name!r} cannot be trained on digits (1x8x8, 10 classes): "
                        f"{type(err).__name__}: {err}") from None
    return net


def _accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    net.eval()
    with torch.no_grad():
        acc = (net(x).argmax(1) == y).float().mean().item()
    net.train()
    return acc


def epochs_to_target(model: str, batch: int, seed: int, target: float, *, rule: LRRule = LRRule(),
                     max_epochs: float = 100.0, evals_per_epoch: int = 4) -> RunResult:
    """Train from scratch at `batch` until held-out accuracy >= target (or max_epochs)."""
    xtr, ytr, xte, yte = digits_split()
    n = len(xtr)
    if not 1 <= batch <= n:
        raise UserError(f"batch {batch} must be between 1 and the {n} training samples of digits")
    net = build_model(model, seed)
    opt = torch.optim.SGD(net.parameters(), lr=rule.lr(batch, 0.0), momentum=rule.momentum)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(seed)
    steps_per_epoch = math.ceil(n / batch)
    eval_every = max(1, round(steps_per_epoch / evals_per_epoch))
    seen, step, best = 0, 0, 0.0
    while seen < max_epochs * n:
        order = torch.randperm(n, generator=gen)
        for i in range(0, n, batch):
            idx = order[i:i + batch]
            for g in opt.param_groups:
                g["lr"] = rule.lr(batch, seen / n)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(net(xtr[idx]), ytr[idx])
            if not torch.isfinite(loss):
                return RunResult(batch, seed, None, step, best)  # diverged: counts as not reached
            loss.backward()
            opt.step()
            seen += len(idx)
            step += 1
            if step % eval_every == 0 or i + batch >= n:
                best = max(best, acc := _accuracy(net, xte, yte))
                if acc >= target:
                    return RunResult(batch, seed, seen / n, step, best)
    return RunResult(batch, seed, None, step, best)


def check_request(model: str, data: str, target: float, batches: Sequence[int], seeds: int) -> None:
    """Reject bad input before any training starts."""
    if data not in DATASETS:
        raise UserError(f"unknown data set {data!r}; known: {', '.join(DATASETS)}")
    if not 0.0 < target < 1.0:
        raise UserError(f"target must be an accuracy in (0, 1), got {target}", param="target")
    if seeds < 1:
        raise UserError(f"seeds must be >= 1, got {seeds}", param="seeds")
    if not batches or len(set(batches)) != len(batches):
        raise UserError("batches must list distinct batch sizes", param="batches")
    n = len(digits_split()[0])
    if max(batches) > n or min(batches) < 1:
        raise UserError(f"batches must be between 1 and the {n} training samples of {data}", param="batches")
    build_model(model, 0)


def measure(model: str, data: str, target: float, batches: Sequence[int], seeds: int = 1, *,
            rule: LRRule = LRRule(), max_epochs: float = 100.0, evals_per_epoch: int = 4,
            on_run: Callable[[RunResult], None] | None = None) -> Measurement:
    """Run every (batch, seed), then fit the McCandlish law to the per-batch mean epochs."""
    check_request(model, data, target, batches, seeds)
    runs = []
    for b in sorted(batches):
        for s in range(seeds):
            r = epochs_to_target(model, b, s, target, rule=rule, max_epochs=max_epochs,
                                 evals_per_epoch=evals_per_epoch)
            runs.append(r)
            if on_run:
                on_run(r)
    m = Measurement(model, data, target, len(digits_split()[0]), rule, tuple(runs), None, None)
    rows = [r for r in m.per_batch() if r["epochs_mean"] is not None]
    table = curve = None
    if rows:
        sds = tuple(r["epochs_sd"] for r in rows) if seeds > 1 else ()
        table = TableCurve(tuple(float(r["batch"]) for r in rows), tuple(r["epochs_mean"] for r in rows),
                           sds, name=f"{model}/{data} measured")
    if len(rows) >= 2:
        notes = [f"{len(m.per_batch()) - len(rows)} batch size(s) never reached the target and are left out"] \
            if len(rows) < len(m.per_batch()) else []
        # Seeds' spread as weights when there is one; floor it at one evaluation interval.
        floor = 1.0 / evals_per_epoch
        sd = [max(r["epochs_sd"], floor) for r in rows] if seeds > 1 else None
        curve = fit_mccandlish([r["batch"] for r in rows], [r["epochs_mean"] for r in rows], sd,
                               name=f"{model}/{data} target {target}", caveats=notes)
    return Measurement(model, data, target, m.samples_per_epoch, rule, tuple(runs), curve, table)


def measurement_json(m: Measurement) -> dict:
    """What `--out` writes and `project --convergence` reads back (`curve` key)."""
    return {"model": m.model, "data": m.data, "target": f"held-out accuracy >= {m.target}",
                "samples_per_epoch": m.samples_per_epoch,
                "lr_rule": {"base_lr": m.rule.base_lr, "base_batch": m.rule.base_batch, "max_lr": m.rule.max_lr,
                             "warmup_epochs": m.rule.warmup_epochs, "momentum": m.rule.momentum},
                "per_batch": m.per_batch(),
                "runs": [{"batch": r.batch, "seed": r.seed, "epochs_to_target": r.epochs_to_target, "steps": r.steps,
                           "best_accuracy": r.best_accuracy} for r in m.runs],
                "curve": m.curve.to_dict() if m.curve else (m.table.to_dict() if m.table else None)}
