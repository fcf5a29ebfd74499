"""Measure op times (forward, backward-data, backward-weight) at the local shapes a model needs.

The shapes come from the model's own Conv2d/Linear modules (forward hooks on one forward pass), so
any nn.Module works; keys are the cost model's (`hybridpar.cost.compute.local_shapes`), so what is
measured here is what `op_time` looks up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.cost.compute import local_shapes
from hybridpar.graph.types import Node
from hybridpar.profile.calibration import Measurement, OpRecord
from hybridpar.profile.timing import measure, summarize


@dataclass(frozen=True)
class OpSpec:
    """One conv2d/linear at a (local) shape, with what is needed to run it."""

    op: str  # "conv2d" | "linear"
    x: tuple[int, ...]
    w: tuple[int, ...]
    y: tuple[int, ...]
    bias: bool = False
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1

    def node(self) -> Node:
        return Node(name="op", op=self.op, in_shapes=(self.x,), out_shape=self.y,
                    param_shapes=(("weight", self.w),))

    @property
    def key(self) -> str:
        return local_shapes(self.node()).key(self.op)

    def local(self, sample_frac: float = 1.0, channel_frac: float = 1.0, filter_frac: float = 1.0) -> OpSpec:
        """This op at the local shape of a sample/channel/filter split (same rule as the cost model)."""
        loc = local_shapes(self.node(), sample_frac, channel_frac, filter_frac)
        return replace(self, x=loc.x, w=loc.w or self.w, y=loc.y)


def collect_op_specs(module: nn.Module, example_inputs: tuple) -> list[OpSpec]:
    """Conv2d and Linear shapes seen in one forward pass of `module` (deduplicated, in order)."""
    found: dict[tuple, OpSpec] = {}

    def hook(mod: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        x = tuple(inputs[0].shape)
        y = tuple(output.shape)
        if isinstance(mod, nn.Conv2d):
            if not isinstance(mod.padding, tuple):
                return  # padding="same"/"valid" strings: shape-equivalent specs not derivable here
            spec = OpSpec("conv2d", x, tuple(mod.weight.shape), y, mod.bias is not None, tuple(mod.stride),
                          tuple(mod.padding), tuple(mod.dilation), mod.groups)
        else:
            spec = OpSpec("linear", x, tuple(mod.weight.shape), y, mod.bias is not None)
        found.setdefault((spec.key, spec.stride, spec.padding, spec.dilation, spec.groups), spec)

    handles = [m.register_forward_hook(hook) for m in module.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    try:
        with torch.no_grad():
            module(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    return list(found.values())


def split_variants(specs: list[OpSpec], splits: tuple[int, ...]) -> list[OpSpec]:
    """Each spec at 1/k of the samples, of the channels and of the filters for every k in `splits`."""
    out: dict[str, OpSpec] = {}
    for s in specs:
        out.setdefault(s.key, s)
        for k in splits:
            if k <= 1:
                continue
            for fr in ((1 / k, 1, 1), (1, 1 / k, 1), (1, 1, 1 / k)):
                if s.groups == 1 or fr[1] == fr[2] == 1:
                    v = s.local(*fr)
                    out.setdefault(v.key, v)
    return list(out.values())


def _forward(spec: OpSpec, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if spec.op == "conv2d":
        return F.conv2d(x, w, b, spec.stride, spec.padding, spec.dilation, spec.groups)
    return F.linear(x, w, b)


def profile_op(spec: OpSpec, *, warmup: int = 2, repeats: int = 7) -> OpRecord:
    """Forward, backward-data (grad of x only) and backward-weight (grad of w only). The three are
    timed in turn within each repeat, so a burst of load from elsewhere hits all three alike."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(spec.x, generator=g).requires_grad_(True)
    w = torch.randn(spec.w, generator=g).requires_grad_(True)
    b = torch.randn(spec.w[0], generator=g).requires_grad_(True) if spec.bias else None
    y = _forward(spec, x, w, b)
    dy = torch.randn(y.shape, generator=g)
    wrt = (w, b) if b is not None else (w,)
    passes = (lambda: _forward(spec, x, w, b),
              lambda: torch.autograd.grad(y, x, dy, retain_graph=True),
              lambda: torch.autograd.grad(y, wrt, dy, retain_graph=True))
    for _ in range(warmup):
        for fn in passes:
            fn()
    samples: list[list[float]] = [[], [], []]
    for _ in range(repeats):
        for i, fn in enumerate(passes):
            t0 = time.perf_counter()
            fn()
            samples[i].append(time.perf_counter() - t0)
    fwd, bwd_data, bwd_weight = (summarize(s) for s in samples)
    return OpRecord(key=spec.key, op=spec.op, fwd=fwd, bwd_data=bwd_data, bwd_weight=bwd_weight)


def matmul_peak(n: int = 512, *, warmup: int = 2, repeats: int = 7) -> tuple[float, Measurement]:
    """Single-thread fp32 matmul FLOP/s (2 n^3 FLOPs per n x n product) from the median time."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    m = measure(lambda: torch.mm(a, b), warmup=warmup, repeats=repeats)
    return 2.0 * n**3 / m.median_s, m


def copy_bandwidth(nbytes: int = 32 << 20, *, warmup: int = 2, repeats: int = 7) -> tuple[float, Measurement]:
    """Memory bandwidth of a large copy: bytes read plus bytes written over the median time."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    m = measure(lambda: dst.copy_(src), warmup=warmup, repeats=repeats)
    return 2.0 * nbytes / m.median_s, m
