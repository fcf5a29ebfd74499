"""Optimizers, learning-rate schedules, gradient clipping and mixed precision for the train loop.

- `make_optimizer("sgd" | "adamw" | "lars", params, lr=..., momentum=..., weight_decay=...)`.
  LARS follows the MLPerf ResNet-50 reference (You et al. 2017, as in the MLPerf v0.6 submissions):
  per parameter, trust ratio eta * |w| / (|g| + wd * |w|) (1 when either norm is 0), update
  v = momentum * v + lr * ratio * (g + wd * w), w -= v; biases and batch-norm parameters (tensors of
  one dimension or less) skip both the trust ratio and the weight decay. Norms are of the whole
  tensor: a parameter split across ranks has its norm summed over its distinct pieces (WholeNorms),
  so every layout takes the same step as one process would.
- `lr_at(step, base, schedule, warmup, total)`: linear warm-up over `warmup` steps to `base`, then
  constant, cosine (to 0 at `total`) or poly (power 2, to 0 at `total`, MLPerf ResNet-50's).
- `clip_grad_norm(params, max_norm, norms)`: the global gradient norm (whole tensors, over every
  rank) and clipping to `max_norm`.
- `autocast(precision, device)`: the forward's autocast context (bf16 on CPU and CUDA).
- fp64 (`to_precision`, `cast_inputs`): the model's floating parameters and buffers are converted to
  float64 once it is built (materialised, loaded from --init-from or a checkpoint), each batch's
  floating inputs are cast to float64, and no autocast runs: for checking a layout against one
  process where float32 rounding alone differs by more than the tolerance (ill-conditioned models).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.errors import UserError

OPTIMIZERS = ("sgd", "adamw", "lars")
SCHEDULES = ("constant", "cosine", "poly")
PRECISIONS = ("fp32", "bf16", "fp16", "fp64")
LARS_ETA = 0.001


def check_options(*, optimizer: str, lr_schedule: str, warmup_steps: int, grad_clip: float | None,
                  precision: str) -> None:
    """UserError (with `param`) for an option the loop cannot run, before any rank starts."""
    for name, value, allowed in (("optimizer", optimizer, OPTIMIZERS), ("lr_schedule", lr_schedule, SCHEDULES),
                                 ("precision", precision, PRECISIONS)):
        if value not in allowed:
            raise UserError(f"{name} must be one of {', '.join(allowed)}, got {value!r}", param=name)
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise UserError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}", param="warmup_steps")
    if grad_clip is not None and (not isinstance(grad_clip, (int, float)) or not math.isfinite(grad_clip)
                                  or grad_clip <= 0):
        raise UserError(f"grad_clip must be a finite number > 0, got {grad_clip!r}", param="grad_clip")
    if precision == "fp16":
        raise UserError("precision fp16 needs loss scaling inside the engine's step, which it does not have "
                        "yet; use bf16", param="precision")


def make_optimizer(name: str, params: Iterable[torch.Tensor], *, lr: float, momentum: float = 0.0,
                   weight_decay: float = 0.0, norms: WholeNorms | None = None) -> torch.optim.Optimizer:
    """`norms`: how this rank's pieces make whole-tensor norms (LARS needs them; None: every
    parameter is whole on this rank)."""
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "lars":
        return LARS(params, lr=lr, momentum=momentum, weight_decay=weight_decay, norms=norms)
    raise UserError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}", param="optimizer")


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class WholeNorms:
    """2-norms of whole tensors from the pieces the ranks hold. A rank holds, per tensor of the
    undistributed model, a piece (or all of it) that `hybridpar.train.checkpoint.local_tensors`
    names with where it sits; pieces at the same place on several ranks are copies. One
    all_gather_object of a few floats per tensor adds up each distinct piece once."""

    def __init__(self, engine=None):
        self.name_of: dict[int, str] = {}
        self.where: dict[str, str] = {}
        if engine is not None:
            from hybridpar.train.checkpoint import local_tensors

            tensors, shards = local_tensors(engine)
            self.name_of = {id(t): n for n, t in tensors.items()}
            self.where = {n: repr(shards.get(n)) for n in tensors}

    def __call__(self, columns: list[dict[int, torch.Tensor]]) -> list[dict[int, float]]:
        """For each column (id(param) -> this rank's piece of some tensor: the weight, its gradient),
        the whole tensor's norm, keyed the same way. Collective."""
        squares = [{i: float(_local(t).detach().float().pow(2).sum()) for i, t in col.items()} for col in columns]
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return [{i: math.sqrt(v) for i, v in sq.items()} for sq in squares]
        mine = {self.name_of.get(i, str(i)): (self.where.get(self.name_of.get(i, ""), "whole"),
                                              [sq[i] for sq in squares]) for i in squares[0]}
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        pieces: dict[str, dict[str, list[float]]] = {}
        for rank_part in gathered:
            for name, (where, values) in rank_part.items():
                pieces.setdefault(name, {})[where] = values  # copies of one piece count once
        whole = {name: [math.sqrt(sum(v[k] for v in by_place.values())) for k in range(len(columns))]
                 for name, by_place in pieces.items()}
        return [{i: whole[self.name_of.get(i, str(i))][k] for i in squares[0]} for k in range(len(columns))]


class LARS(torch.optim.Optimizer):
    """Layer-wise adaptive rate scaling with momentum (MLPerf ResNet-50 reference); see the module doc."""

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0, eta: float = LARS_ETA,
                 norms: WholeNorms | None = None):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "eta": eta})
        self.norms = norms or WholeNorms()

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        weights = {id(p): p for g in self.param_groups for p in g["params"] if p.grad is not None and p.dim() > 1}
        w_norm, g_norm = self.norms([weights, {i: p.grad for i, p in weights.items()}])
        for group in self.param_groups:
            lr, mom, wd, eta = group["lr"], group["momentum"], group["weight_decay"], group["eta"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if id(p) in weights:  # weights: trust ratio and weight decay
                    wn, gn = w_norm[id(p)], g_norm[id(p)]
                    ratio = eta * wn / (gn + wd * wn) if wn > 0 and gn > 0 else 1.0
                    update = p.grad.add(p, alpha=wd).mul_(lr * ratio)
                else:  # biases and batch-norm parameters: plain momentum SGD
                    update = p.grad.mul(lr)
                state = self.state[p]
                if mom:
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = update.clone()
                    else:
                        buf.mul_(mom).add_(update)
                    update = buf
                p.sub_(update)
        return loss


def lr_at(step: int, base: float, schedule: str = "constant", warmup: int = 0, total: int = 1) -> float:
    """Learning rate of (0-based) `step`."""
    if warmup and step < warmup:
        return base * (step + 1) / warmup
    span = max(1, total - warmup)
    t = min(max(step - warmup, 0), span) / span
    if schedule == "cosine":
        return base * 0.5 * (1.0 + math.cos(math.pi * t))
    if schedule == "poly":
        return base * (1.0 - t) ** 2
    return base


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, norms: WholeNorms | None = None) -> float:
    """Scale every gradient so that the global norm of the whole model's gradient is at most
    `max_norm` (collective when `norms` spans ranks); returns the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    per_tensor = (norms or WholeNorms())([{id(p): p.grad for p in params}])[0]
    total = math.sqrt(sum(v * v for v in per_tensor.values()))
    if math.isfinite(total) and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for p in params:
            _local(p.grad).mul_(scale)
    return total


def param_dtype(precision: str) -> torch.dtype | None:
    """The dtype the model's floating tensors are converted to (None: kept as built)."""
    return torch.float64 if precision == "fp64" else None


def to_precision(module: nn.Module, precision: str) -> nn.Module:
    """`module` with its floating parameters and buffers in the run's dtype (in place; nn.Module.to
    converts floating tensors only: integer buffers such as num_batches_tracked stay)."""
    dtype = param_dtype(precision)
    return module.to(dtype) if dtype is not None else module


def cast_inputs(x, precision: str):
    """A batch's floating inputs (a tensor, a tuple/list or dict of them) in the run's dtype; token
    ids, masks and other non-floating inputs as they are."""
    dtype = param_dtype(precision)
    if dtype is None:
        return x
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, x)


def autocast(precision: str, device: torch.device):
    """The autocast context of a training step's forward (nothing for fp32 and fp64)."""
    if precision in ("fp32", "fp64"):
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


@dataclass(frozen=True)
class OptimConfig:
    """The `[optim]` section of a run: the optimizer and its settings, the learning-rate schedule,
    gradient clipping and the numeric precision of the step."""

    optimizer: str = "sgd"  # sgd | adamw | lars
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    lr_schedule: str = "constant"  # constant | cosine | poly, after `warmup_steps` of linear warm-up
    warmup_steps: int = 0
    grad_clip: float | None = None  # clip the global gradient norm to this
    precision: str = "fp32"  # fp32 | bf16 (autocast) | fp64

    def check(self) -> None:
        """UserError (with `param`) for a setting the loop cannot run."""
        for name in ("lr", "momentum", "weight_decay"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise UserError(f"{name} must be a finite number, got {v!r}", param=name)
        if self.lr <= 0:
            raise UserError(f"lr must be > 0, got {self.lr}", param="lr")
        for name in ("momentum", "weight_decay"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}", param=name)

    def check_options(self) -> None:
        """The choices and the schedule (check_options), after the run's other checks."""
        check_options(optimizer=self.optimizer, lr_schedule=self.lr_schedule, warmup_steps=self.warmup_steps,
                      grad_clip=self.grad_clip, precision=self.precision)

    @property
    def state_slots(self) -> int:
        """Buffers of the weights' size the optimizer keeps (AdamW: 2; SGD and LARS with momentum: 1)."""
        return 2 if self.optimizer == "adamw" else 1 if self.momentum else 0
