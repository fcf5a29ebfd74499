"""Measure op times (forward, backward-data, backward-weight) at the local shapes a model needs.

The shapes come from the model's own modules (forward hooks on one forward pass: Conv2d, Linear,
BatchNorm2d, ReLU and the 2-d poolings), so any nn.Module works; keys are the cost model's
(`hybridpar.cost.compute.local_shapes`), so what is measured here is what `op_time` looks up.
Batch norm is measured twice: as nn.BatchNorm2d ("batchnorm": local statistics, or one sample
group) and as the runtime's global-statistics function without its two allreduces
("batchnorm_global": what a rank computes when samples are split). The poolings and batch norm were
2-4x off the roofline on this CPU (max-pool 4x slower), which is why they are measured, not modelled.
Each can also be timed as `train --channels-last` (NHWC 4-D tensors) and `--precision bf16` (autocast)
run it, under its own record name (cluster.calibration.format_op: `conv2d#cl`, `conv2d#bf16`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.cluster.calibration import Measurement, OpRecord, format_op
from hybridpar.cost.compute import local_shapes
from hybridpar.graph.ops import NHWC_KINDS, channels_last_strides
from hybridpar.graph.recurrent import DEFAULT_TIME_CHUNKS, chunk_steps
from hybridpar.graph.types import Node
from hybridpar.profile.timing import clock, measure, summarize, timed_grad


@dataclass(frozen=True)
class OpSpec:
    """One op at a (local) shape, with what is needed to run it."""

    # "conv2d" | "linear" | "batchnorm" | "batchnorm_global" | "relu" | "maxpool" | "avgpool" | "adaptive_avgpool"
    op: str
    x: tuple[int, ...]
    w: tuple[int, ...] | None
    y: tuple[int, ...]
    bias: bool = False
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    kernel: tuple[int, int] = (1, 1)  # poolings
    ceil_mode: bool = False
    bias_lstm: bool = True  # lstm: with biases (its weights are named weight_ih/_hh: no "weight" key)
    # "channels_last": a 4-D op timed on NHWC input, weights and output gradient, recorded under its
    # own name (cluster.calibration.format_op), as `train --channels-last` runs it
    memory_format: str = "nchw"
    # "bf16": timed as a bf16 autocast step runs it (forward under autocast, backward outside), its input
    # in the dtype it arrives in there (`x_dtype`: the model's fp32 batch, or a bf16 layer's output)
    precision: str = "fp32"
    x_dtype: str = "fp32"
    # "channels_last": the model's own forward hands this op its input NHWC in memory (HF ConvNeXt's
    # depthwise convolutions, after a permute), so `model_nhwc_variants` times it in that format too
    x_format: str = "nchw"

    def node(self) -> Node:
        op = "batchnorm" if self.op == "batchnorm_global" else self.op
        params = (("weight", self.w),) if self.w else ()
        return Node(name="op", op=op, in_shapes=(self.x,), out_shape=self.y, param_shapes=params)

    @property
    def key(self) -> str:
        return local_shapes(self.node()).key(self.record_op)

    @property
    def record_op(self) -> str:
        """The op's name in the calibration file (its memory format's and precision's)."""
        return format_op(self.op, self.memory_format, self.precision)

    @property
    def image(self) -> bool:
        """A 4-D op: one that can run in channels-last memory."""
        return len(self.x) == 4 and self.op != "lstm"

    def local(self, sample_frac: float = 1.0, channel_frac: float = 1.0, filter_frac: float = 1.0) -> OpSpec:
        """This op at the local shape of a sample/channel/filter split (same rule as the cost model)."""
        loc = local_shapes(self.node(), sample_frac, channel_frac, filter_frac)
        return replace(self, x=loc.x, w=loc.w or self.w, y=loc.y)


_NORMS = ("batchnorm", "batchnorm_global")
_MODULES = (nn.Conv2d, nn.Linear, nn.BatchNorm2d, nn.ReLU, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d,
            nn.LSTM)
# one backward computes the input's and the weights' gradients together: all of it is backward-data
_WHOLE_BACKWARD = (*_NORMS, "lstm")


def _pair(v) -> tuple[int, int]:
    return tuple(v) if isinstance(v, (tuple, list)) else (int(v), int(v))


def _specs_of(mod: nn.Module, x: tuple[int, ...], y: tuple[int, ...]) -> list[OpSpec]:
    if isinstance(mod, nn.LSTM):
        # unidirectional batch-first layers without projection, one layer at a time: the MP runtime places
        # a stacked module's layers one by one (wavefront.py), and the cost model prices a stack as the
        # sum of its layers (cost.compute; issue 13: the roofline put a small CPU LSTM at 3x its measured
        # time; a 4-layer stack left unprofiled was priced at 6.6x its one-process step)
        if mod.bidirectional or not mod.batch_first or mod.proj_size or len(x) != 3:
            return []
        # and each at the steps of its time chunks under the placer's default K (cost.compute.chunk_time)
        specs = []
        k = DEFAULT_TIME_CHUNKS
        for steps in dict.fromkeys([x[1]] + [chunk_steps(x[1], t, k) for t in range(k)]):
            if steps:
                xs, ys = (x[0], steps, x[2]), (y[0], steps, y[2])
                specs.append(OpSpec("lstm", xs, None, ys, bias_lstm=mod.bias))
                if mod.num_layers > 1:
                    specs.append(OpSpec("lstm", ys, None, ys, bias_lstm=mod.bias))
        return specs
    if isinstance(mod, nn.Conv2d):
        if not isinstance(mod.padding, tuple):
            return []  # padding="same"/"valid" strings: shape-equivalent specs not derivable here
        return [OpSpec("conv2d", x, tuple(mod.weight.shape), y, mod.bias is not None, tuple(mod.stride),
                       tuple(mod.padding), tuple(mod.dilation), mod.groups)]
    if isinstance(mod, nn.Linear):
        return [OpSpec("linear", x, tuple(mod.weight.shape), y, mod.bias is not None)]
    if isinstance(mod, nn.BatchNorm2d):
        w = (x[1],) if mod.affine else None
        return [OpSpec("batchnorm", x, w, y), OpSpec("batchnorm_global", x, w, y)]
    if isinstance(mod, nn.ReLU):
        return [OpSpec("relu", x, None, y)]
    if isinstance(mod, (nn.MaxPool2d, nn.AvgPool2d)):
        if isinstance(mod, nn.MaxPool2d) and _pair(mod.dilation) != (1, 1):
            return []
        return [OpSpec("maxpool" if isinstance(mod, nn.MaxPool2d) else "avgpool", x, None, y,
                       stride=_pair(mod.stride or mod.kernel_size), padding=_pair(mod.padding),
                       kernel=_pair(mod.kernel_size), ceil_mode=bool(mod.ceil_mode))]
    return [OpSpec("adaptive_avgpool", x, None, y)]


def collect_op_specs(module: nn.Module, example_inputs: tuple, precision: str = "fp32") -> list[OpSpec]:
    """The shapes of the ops `op_time` can look up, seen in one forward pass of `module` (deduplicated,
    in order); `precision` "bf16": the pass runs under bf16 autocast, as a bf16 step does, and each op
    keeps the dtype its input arrived in."""
    found: dict[tuple, OpSpec] = {}

    def hook(mod: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if isinstance(mod, nn.LSTM) and isinstance(output, tuple):
            output = output[0]  # (out, (h, c))
        if not isinstance(output, torch.Tensor) or not inputs or not isinstance(inputs[0], torch.Tensor):
            return
        x_dtype = "bf16" if inputs[0].dtype == torch.bfloat16 else "fp32"
        x_format = "channels_last" if nhwc_only(inputs[0]) else "nchw"
        for spec in _specs_of(mod, tuple(inputs[0].shape), tuple(output.shape)):
            spec = replace(spec, precision=precision, x_dtype=x_dtype, x_format=x_format)
            found.setdefault((spec.key, spec.stride, spec.padding, spec.dilation, spec.groups, spec.kernel), spec)

    handles = [m.register_forward_hook(hook) for m in module.modules() if isinstance(m, _MODULES)]
    try:
        with torch.no_grad(), autocast(precision):
            module(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    return list(found.values())


def _factorisations(k: int) -> list[tuple[int, int, int]]:
    """Every (sample, channel, filter) with sample x channel x filter = k: the layouts of k ranks."""
    return [(k // (c * f), c, f) for c in range(1, k + 1) if k % c == 0
            for f in range(1, k // c + 1) if (k // c) % f == 0]


def split_variants(specs: list[OpSpec], splits: tuple[int, ...]) -> list[OpSpec]:
    """Each spec at the local shape of every layout of k ranks for every k in `splits` (1/s of the
    samples, 1/c of the channels, 1/f of the filters, s c f = k: combined layouts such as
    sample=2,channel=2 too), so the planner finds each piece's own time; grouped convolutions and
    LSTMs split samples only. An LSTM's piece must be measured, not scaled from the whole batch: its
    time is mostly the per-time-step kernels, so half the batch took about as long on this CPU (the
    two-tower LSTM's sample=2 step was predicted 8.3 ms against 14.1 ms measured with the scaled
    piece, bench_validation of 2026-12-01 04:07)."""
    out: dict[str, OpSpec] = {}
    for s in specs:
        out.setdefault(s.key, s)
        for k in splits:
            if k <= 1:
                continue
            for sa, c, f in _factorisations(k):
                if (s.groups == 1 and s.op != "lstm") or c == f == 1:
                    v = s.local(1 / sa, 1 / c, 1 / f)
                    out.setdefault(v.key, v)
    return list(out.values())


def channels_last_variants(specs: list[OpSpec]) -> list[OpSpec]:
    """The 4-D ops of `specs` again, to be timed in channels-last memory."""
    return [replace(s, memory_format="channels_last") for s in specs if s.image and s.memory_format == "nchw"]


def autocast(precision: str, device: str = "cpu"):
    """The forward's autocast context at `precision` (as `train --precision` runs a step)."""
    import contextlib

    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device.split(":")[0], dtype=torch.bfloat16)


def nhwc_only(t: torch.Tensor) -> bool:
    """A tensor with channels-last strides, not NCHW's (graph.ops.channels_last_strides)."""
    return channels_last_strides(tuple(t.shape), tuple(t.stride()))


def as_nhwc(t: torch.Tensor) -> torch.Tensor:
    """A 4-D `t` in channels-last strides: itself where it has them, else a copy (`contiguous` keeps a 1x1
    image's NCHW strides)."""
    if nhwc_only(t):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device, memory_format=torch.channels_last).copy_(t)


def _formatted(spec: OpSpec, t: torch.Tensor) -> torch.Tensor:
    """`t` in the spec's memory format where it is 4-D (the channels-last run converts 4-D weights and
    inputs; a convolution then returns, and its backward receives, channels-last tensors)."""
    if spec.memory_format == "channels_last" and t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    return t


def _arriving(spec: OpSpec, t: torch.Tensor) -> torch.Tensor:
    """An activation (the input, the output's gradient) in the spec's memory format: in channels-last
    with the strides a channels-last run gives it, even where `contiguous` would keep NCHW's."""
    return as_nhwc(t) if spec.memory_format == "channels_last" and t.dim() == 4 else t


def model_nhwc_variants(specs: list[OpSpec], splits: tuple[int, ...]) -> list[OpSpec]:
    """The specs whose input the model's own forward hands over NHWC (`x_format`), again in the
    channels_last format, whole and at each sample piece: a plain run's op on such an input is priced
    from these records (cost.compute.op_time). Not at channel/filter pieces: the runtime gathers those
    into NCHW tensors. oneDNN ran HF ConvNeXt's 7x7 depthwise convolutions 1.4-17x faster on the NHWC
    inputs the model gives them than on NCHW copies (issue 35: its held-out sample=2 rows +21-38%)."""
    out: dict[str, OpSpec] = {}
    for s in specs:
        if s.x_format == "channels_last" and s.memory_format == "nchw" and s.op in NHWC_KINDS:
            for k in dict.fromkeys((1, *splits)):
                v = replace(s.local(1 / k) if k > 1 else s, memory_format="channels_last")
                out.setdefault(v.key, v)
    return list(out.values())


def _forward(spec: OpSpec, x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
    if spec.op == "conv2d":
        return F.conv2d(x, w, b, spec.stride, spec.padding, spec.dilation, spec.groups)
    if spec.op == "linear":
        return F.linear(x, w, b)
    if spec.op == "lstm":
        return w(x)[0]
    if spec.op == "batchnorm":
        return F.batch_norm(x, None, None, w, b, True, 0.1, 1e-5)
    if spec.op == "batchnorm_global":
        return _global_bn(x, w, b)
    if spec.op == "relu":
        return F.relu(x)
    if spec.op == "maxpool":
        return F.max_pool2d(x, spec.kernel, spec.stride, spec.padding, ceil_mode=spec.ceil_mode)
    if spec.op == "avgpool":
        return F.avg_pool2d(x, spec.kernel, spec.stride, spec.padding, ceil_mode=spec.ceil_mode)
    return F.adaptive_avg_pool2d(x, spec.y[2:])


def _global_bn(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
    """The runtime's global-statistics batch norm on a one-rank group: its local work, no collective."""
    from hybridpar.parallel.comm.log import CommLog
    from hybridpar.parallel.mesh import Group
    from hybridpar.parallel.styles.norm import GlobalBatchNormFunction, NormComm

    comm = NormComm(Group((0,), None, 0), CommLog(), "profile")
    return GlobalBatchNormFunction.apply(x, w, b, 1e-5, comm, x.shape[0] * math.prod(x.shape[2:]))[0]


def profile_op(spec: OpSpec, *, warmup: int = 2, repeats: int = 7) -> OpRecord:
    """Forward, backward-data (grad of x only) and backward-weight (grad of w only), as CPU time of
    this thread (profile.timing), each repeat on a fresh copy of the input, as a training step runs
    it. The three are timed in turn within each repeat, so a burst of load from elsewhere (cache
    pressure) hits all three alike."""
    g = torch.Generator().manual_seed(0)
    x = _arriving(spec, torch.randn(spec.x, generator=g).to(_TORCH_DTYPES[spec.x_dtype])).requires_grad_(True)
    w = b = None
    if spec.op == "lstm":
        w = nn.LSTM(spec.x[2], spec.y[2], batch_first=True, bias=spec.bias_lstm)  # the module: weights, biases
    elif spec.op in _NORMS:
        if spec.w is not None:  # affine, over this rank's channels
            w = torch.randn(spec.x[1], generator=g).requires_grad_(True)
            b = torch.randn(spec.x[1], generator=g).requires_grad_(True)
    elif spec.op in ("conv2d", "linear"):
        w = _formatted(spec, torch.randn(spec.w, generator=g)).requires_grad_(True)
        b = torch.randn(spec.w[0], generator=g).requires_grad_(True) if spec.bias else None
    with autocast(spec.precision):
        y0 = _forward(spec, x, w, b)
    dy0 = _arriving(spec, torch.randn(y0.shape, generator=g).to(y0.dtype))
    wrt = tuple(w.parameters()) if spec.op == "lstm" else tuple(t for t in (w, b) if t is not None)
    whole = spec.op in _WHOLE_BACKWARD  # one backward computes dx, dw and db: all of it is backward-data
    n_passes = 2 if whole or not wrt else 3
    samples: list[list[float]] = [[] for _ in range(n_passes)]
    for k in range(warmup + repeats):
        # fresh input and output gradient each repeat, as each training step has: a conv on the same
        # input tensor again took 0.8-0.95 ms, on a fresh copy 3.2-3.8 ms (oneDNN, this CPU); the
        # table was ~2x under the runtime's steps before (clone keeps the memory format)
        xr = x.detach().clone().requires_grad_(True)
        dy = dy0.clone()
        t0 = clock()
        with autocast(spec.precision):
            y = _forward(spec, xr, w, b)
        t1 = clock()
        # each timed apart, without the engine start-up a step's one backward pays once (timed_grad)
        times = [t1 - t0, timed_grad(y, (xr, *wrt) if whole else xr, dy, retain_graph=not whole and bool(wrt))]
        if n_passes == 3:
            times.append(timed_grad(y, wrt, dy))
        if k >= warmup:
            for i, t in enumerate(times):
                samples[i].append(t)
    fwd, bwd_data, *rest = (summarize(s) for s in samples)
    return OpRecord(key=spec.key, op=spec.record_op, fwd=fwd, bwd_data=bwd_data, bwd_weight=rest[0] if rest else None)


_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def matmul_peak(n: int = 512, *, dtype: str = "fp32", warmup: int = 2, repeats: int = 7) -> tuple[float, Measurement]:
    """Single-thread matmul FLOP/s in `dtype` (2 n^3 FLOPs per n x n product) from the median time."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(_TORCH_DTYPES[dtype]) for _ in range(2))
    m = measure(lambda: torch.mm(a, b), warmup=warmup, repeats=repeats)
    return 2.0 * n**3 / m.median_s, m


CURVE_SIZES = (16, 32, 64, 128, 256, 512)


def matmul_curve(sizes=CURVE_SIZES, *, warmup: int = 2, repeats: int = 7) -> list[tuple[float, float]]:
    """(FLOPs, FLOP/s) of single-thread fp32 n x n matmuls: how a piece's rate falls with its size
    (n = 16 ran at a fifth of n = 512's rate here)."""
    out = []
    for n in sizes:
        rate, _ = matmul_peak(n, warmup=warmup, repeats=max(repeats, 5))
        out.append((2.0 * n**3, rate))
    return out


def bf16_matmul_peak(*, warmup: int = 2, repeats: int = 7) -> tuple[float, Measurement]:
    """Single-thread bf16 matmul FLOP/s, the faster of n = 512 and 1024: bf16 runs on matrix units
    where the CPU has them (AMX: ~1 TFLOP/s per core measured here, 12x fp32), and small products do
    not fill them (n = 256 ran at an eighth of n = 512's rate). Autocast's bf16 runs are held to it."""
    # two warm-up runs at least: the first bf16 product builds its kernel (oneDNN), 10x the steady time
    return max((matmul_peak(n, dtype="bf16", warmup=max(2, warmup), repeats=repeats) for n in (512, 1024)),
               key=lambda r: r[0])


def copy_bandwidth(nbytes: int = 32 << 20, *, warmup: int = 2, repeats: int = 7) -> tuple[float, Measurement]:
    """Memory bandwidth of a large copy: bytes read plus bytes written over the median time."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    m = measure(lambda: dst.copy_(src), warmup=warmup, repeats=repeats)
    return 2.0 * nbytes / m.median_s, m
