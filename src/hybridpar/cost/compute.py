"""Compute time of one graph node under a decomposition: measured table first, roofline otherwise.

Local shape. A layer split `sample`/`channel`/`filter` ways runs on one device with the fractions
sample_frac = 1/sample, channel_frac = 1/channel, filter_frac = 1/filter:
  - conv2d (x N,C,H,W; w F,C,k,k; y N,F,H',W') and linear (in_features = C, out_features = F):
    N, C and F are each cut to ceil(dim * frac) (uneven shards: the largest shard sets the time);
    stationary-x has channel_frac < 1, stationary-y filter_frac < 1, stationary-w both.
  - ops without weights work on their local tensor: all sizes scale by sample*channel*filter fractions.
Forward, backward-data (grad of the input) and backward-weight (grad of the weights) are separate.

Splitting costs efficiency: a piece's compute runs at its class's efficiency times a size factor in
(0, 1] of its own FLOPs (per pass), so a layer split k ways takes more than 1/k of its time when the
pieces are small. GPUs: the published GEMM/convolution efficiency-vs-size curve in
size_efficiency.yaml (DeepBench V100, an approximation for the other GPUs). localhost: measured op
times per local shape first (`hybridpar profile --splits`), else the matmul rate-vs-size curve that
`hybridpar profile` measures (calibration `matmul_curve`); without a calibration no size factor.

Memory format and precision: a channels-last run's NHWC ops (`channels_last_layout`) are looked up
among the records `hybridpar profile --channels-last` timed so, a bf16 plan's among those timed under
bf16 autocast (`--precision bf16`); a channels-last activation read in NCHW order is a priced copy.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

from hybridpar.cluster.calibration import (
    MEMORY_FORMATS,
    PRECISIONS,
    Calibration,
    LayoutStep,
    OpRecord,
    RuntimeOverhead,
    format_op,
    model_key,
    op_key,
    resolve_calibration,
)
from hybridpar.cluster.model import Cluster, DeviceSpec
from hybridpar.cost.spatial import RECOMPUTES_FORWARD, SPATIAL_WHOLE_SHAPES
from hybridpar.graph.recurrent import chunk_steps, layer_nodes, record_op, time_slice
from hybridpar.graph.types import DTYPE_BYTES, NHWC_IN, Graph, Node

EFFICIENCY_FILE = Path(__file__).with_name("efficiency.yaml")
SIZE_EFFICIENCY_FILE = Path(__file__).with_name("size_efficiency.yaml")
_SIZE_KIND = {"conv2d": "conv", "linear": "gemm", "attention": "gemm"}  # ops given the size factor

_CLASS = {
    "conv2d": "conv2d", "linear": "linear", "lstm": "lstm", "attention": "attention",
    "embedding": "embedding", "batchnorm": "normalization", "layernorm": "normalization",
    "maxpool": "pooling", "avgpool": "pooling", "adaptive_avgpool": "pooling",
    "relu": "elementwise", "pointwise": "elementwise", "add": "elementwise", "mul": "elementwise",
    "concat": "elementwise", "dropout": "elementwise", "softmax": "softmax", "loss": "softmax",
}
# views and graph plumbing: no work; the one set (cost.coverage and profile.graph_ops skip these too)
FREE_OPS = frozenset({"input", "output", "flatten", "reshape"})
_FREE = FREE_OPS
_MATMUL = {"conv2d", "linear", "lstm", "attention"}  # run at the dtype's tensor-core rate


@dataclass(frozen=True)
class OpTime:
    fwd_s: float
    bwd_data_s: float
    bwd_weight_s: float
    # "measured", "measured-scaled", "roofline" or "layout-copy" (a channels-last activation copied into
    # NCHW order: `format_copy_time`); a measured variant adds ":<variant>"
    source: str = "roofline"
    # priced channels-last and this op had no record in that format: its time is NCHW's
    # (a measured NCHW record, or the roofline, which knows no format); the plan's notes say so
    as_nchw: bool = False

    @property
    def bwd_s(self) -> float:
        return self.bwd_data_s + self.bwd_weight_s

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s


@dataclass(frozen=True)
class LocalShapes:
    x: tuple[int, ...]
    w: tuple[int, ...] | None
    y: tuple[int, ...]
    x_frac: float  # local / global size of the input, weights, output and FLOPs
    w_frac: float
    y_frac: float
    flop_frac: float

    def key(self, op: str) -> str:
        return op_key(op, self.x, self.w, self.y)


def _weight_shape(node: Node) -> tuple[int, ...] | None:
    for name, shape in node.param_shapes:
        if name.endswith("weight"):
            return tuple(shape)
    return None


def local_shapes(node: Node, sample_frac: float = 1.0, channel_frac: float = 1.0,
                 filter_frac: float = 1.0) -> LocalShapes:
    """The shapes one device works on (see the module docstring)."""
    for name, f in (("sample_frac", sample_frac), ("channel_frac", channel_frac), ("filter_frac", filter_frac)):
        if not 0 < f <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {f}")
    x = tuple(node.in_shapes[0]) if node.in_shapes else ()
    y = tuple(node.out_shape)
    w = _weight_shape(node)
    if node.op in ("conv2d", "linear") and w is not None and x and y:
        cdim = 1 if node.op == "conv2d" else len(x) - 1
        fdim = 1 if node.op == "conv2d" else len(y) - 1
        n, c, f = x[0], x[cdim], y[fdim]
        n2, c2, f2 = (max(1, math.ceil(v * fr)) for v, fr in ((n, sample_frac), (c, channel_frac), (f, filter_frac)))
        xl = list(x)
        xl[0], xl[cdim] = n2, c2
        yl = list(y)
        yl[0], yl[fdim] = n2, f2
        wl = list(w)
        wl[0] = f2
        if len(wl) > 1:
            wl[1] = max(1, math.ceil(w[1] * channel_frac))
        sn, sc, sf = n2 / n, c2 / c, f2 / f
        return LocalShapes(tuple(xl), tuple(wl), tuple(yl), sn * sc, sc * sf, sn * sf, sn * sc * sf)
    frac = sample_frac * channel_frac * filter_frac

    def cut(shape: tuple[int, ...]) -> tuple[int, ...]:
        if not shape:
            return shape
        out = list(shape)
        out[0] = max(1, math.ceil(shape[0] * sample_frac))
        if len(out) > 1:
            out[1] = max(1, math.ceil(shape[1] * channel_frac * filter_frac))
        return tuple(out)

    return LocalShapes(cut(x), w, cut(y), frac, 1.0, frac, frac)


@lru_cache(maxsize=4)
def _yaml(path: Path) -> dict:
    """A data file parsed once, with libyaml's parser when built (10x the pure-Python one's speed:
    the planner of a zoo model spent ~0.1 s here)."""
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@lru_cache(maxsize=1)
def efficiency_table() -> dict:
    return _yaml(EFFICIENCY_FILE)


Curve = tuple[tuple[float, ...], tuple[float, ...]]  # (log10 FLOPs, factor), increasing in both


def monotone_curve(points: Iterable[tuple[float, float]]) -> Curve:
    """(log10 FLOPs, efficiency) points -> a factor in (0, 1]: efficiencies capped at 1, the running
    maximum from small to large sizes, divided by the value at the largest size."""
    xs, ys, best = [], [], 0.0
    for x, eff in sorted(points):
        best = max(best, min(1.0, float(eff)))
        xs.append(float(x))
        ys.append(best)
    if not ys or ys[-1] <= 0:
        raise ValueError("an efficiency curve needs at least one positive point")
    return tuple(xs), tuple(y / ys[-1] for y in ys)


@lru_cache(maxsize=8)
def size_curve(precision: str, kind: str) -> Curve:
    """The GPU size factor curve of `kind` ("gemm" | "conv") at `precision` ("fp32" | "fp16"), from
    the best efficiency of each size bin in size_efficiency.yaml."""
    pts = _yaml(SIZE_EFFICIENCY_FILE)["curves"][precision][kind]
    return monotone_curve((x, best) for x, best, *_ in pts)


def curve_factor(curve: Curve, flops: float) -> float:
    """The curve at `flops`: linear in log10 FLOPs between points, held at the ends."""
    xs, ys = curve
    if flops <= 0:
        return 1.0
    x = math.log10(flops)
    i = bisect.bisect_right(xs, x)
    if i == 0:
        return ys[0]
    if i == len(xs):
        return ys[-1]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


_CPU_CURVES: dict[int, tuple[Calibration, Curve | None]] = {}


def cpu_curve(cal: Calibration) -> Curve | None:
    """localhost's measured matmul rate-vs-size curve (None in calibrations without one); built once
    per calibration object (op_time asks for every op)."""
    hit = _CPU_CURVES.get(id(cal))
    if hit is not None and hit[0] is cal:
        return hit[1]
    curve = None
    if cal.matmul_curve:
        top = max(rate for _, rate in cal.matmul_curve)
        curve = monotone_curve((math.log10(f), rate / top) for f, rate in cal.matmul_curve)
    if len(_CPU_CURVES) > 64:
        _CPU_CURVES.clear()
    _CPU_CURVES[id(cal)] = (cal, curve)
    return curve


def size_factor(op: str, device: DeviceSpec, dtype: str, flops: float, cpu: Curve | None = None,
                thin: float | None = None) -> float:
    """How much of its class's efficiency a kernel of `flops` FLOPs gets (module docstring); `thin`:
    the smaller output dimension min(M, N) of its GEMM, when known (GPUs: the smaller factor wins)."""
    kind = _SIZE_KIND.get(op)
    if kind is None or flops <= 0:
        return 1.0
    if device.kind == "gpu":
        tensor_cores = dtype in ("fp16", "bf16", "tf32") and device.peak(dtype) > device.peak("fp32")
        precision = "fp16" if tensor_cores else "fp32"  # DeepBench's tensor-core (fp16) rows for TF32 too
        return _gpu_factor(kind, precision, flops, thin)
    return _cpu_factor(cpu, flops) if cpu is not None else 1.0


# memoised: the planner prices the same piece sizes under many layouts (ResNet-50 at 1,024 GPUs: ~4k calls)
@lru_cache(maxsize=1 << 16)
def _gpu_factor(kind: str, precision: str, flops: float, thin: float | None) -> float:
    f = curve_factor(size_curve(precision, kind), flops)
    return min(f, curve_factor(size_curve(precision, "thin"), thin)) if thin else f


@lru_cache(maxsize=1 << 16)
def _cpu_factor(curve: Curve, flops: float) -> float:
    return curve_factor(curve, flops)


def gemm_thinness(node: Node, loc: LocalShapes) -> tuple[int, int, int] | None:
    """min(M, N) of the forward, backward-data and backward-weight GEMMs of a conv2d (as an implicit
    GEMM: M = samples x output pixels, N = filters per group) or linear piece; None for other ops."""
    if loc.w is None or not loc.x or not loc.y:
        return None
    if node.op == "conv2d" and len(loc.x) == 4 and len(loc.y) == 4 and len(loc.w) == 4:
        g = int(node.attr("groups", 1) or 1)
        n, _, h, w = loc.x
        f_per_group, c_per_group, r, s = max(1, loc.w[0] // g), loc.w[1], loc.w[2], loc.w[3]
        return (min(n * loc.y[2] * loc.y[3], f_per_group), min(n * h * w, c_per_group),
                min(f_per_group, c_per_group * r * s))
    if node.op == "linear":
        rows, c, f = math.prod(loc.x[:-1]), loc.x[-1], loc.y[-1]
        return min(rows, f), min(rows, c), min(f, c)
    return None


def op_class(op: str) -> str:
    return _CLASS.get(op, "other")


def _nbytes(shapes: Iterable[tuple[int, ...]], dtype: str) -> float:
    return float(sum(math.prod(s) for s in shapes if s)) * DTYPE_BYTES[dtype]


def compute_dtype(op: str, dtype: str, device: DeviceSpec) -> str:
    """The rate an op of a `dtype` model runs at. PyTorch runs fp32 convolutions on TF32 tensor cores
    where the GPU has them (torch.backends.cudnn.allow_tf32 is True by default; fp32 matmuls are not:
    torch.backends.cuda.matmul.allow_tf32 is False), so a GPU with a TF32 rate (A100, H100) prices fp32
    convolutions at it. Measured on an H200 (2026-11-30, ResNet-50, batch 64, plain PyTorch 2.11):
    32.1 ms per step, against 66.6 ms predicted at the fp32 peak and 29.7 ms at the TF32 peak."""
    if dtype == "fp32" and op == "conv2d" and "tf32" in device.peak_flops:
        return "tf32"
    return dtype


def no_input_grad(node: Node) -> bool:
    """True where autograd computes no gradient of the node's input: its inputs come from the model's
    inputs alone (graph.build's `input_grad` attribute: a Conv3d or Conv2d stem, a pooling of the
    image), or a weighted op with no data-gradient FLOPs (graphs traced before the attribute). Not a
    recurrent layer: its one fused backward kernel is timed under backward-data (profile.graph_ops)."""
    if node.op == "lstm":
        return False
    return node.attr("input_grad") is False or (node.op in _MATMUL and node.bwd_data_flops == 0)


def roofline_time(node: Node, device: DeviceSpec, *, dtype: str = "fp32", sample_frac: float = 1.0,
                  channel_frac: float = 1.0, filter_frac: float = 1.0, cpu: Curve | None = None) -> OpTime:
    """max(FLOPs / (peak * compute_eff * size_factor(FLOPs)), bytes / (mem_bw * memory_eff)) + launch,
    per pass (`cpu`: localhost's measured matmul curve for the size factor)."""
    if node.op in _FREE:
        return OpTime(0.0, 0.0, 0.0)
    loc = local_shapes(node, sample_frac, channel_frac, filter_frac)
    table = efficiency_table()[device.kind]
    eff = table["classes"][op_class(node.op)]
    rate_dtype = compute_dtype(node.op, dtype, device)
    peak = device.peak(rate_dtype) if node.op in _MATMUL else device.peak("fp32")
    b = DTYPE_BYTES[dtype]
    x_b = _nbytes(node.in_shapes, dtype) * loc.x_frac
    y_b = node.out_numel * b * loc.y_frac
    w_b = node.params * b * loc.w_frac

    thin = gemm_thinness(node, loc) or (None, None, None)

    def t(flops: float, bytes_: float, thin_dim: int | None) -> float:
        if flops <= 0 and bytes_ <= 0:
            return 0.0
        rate = peak * eff["compute"] * size_factor(node.op, device, rate_dtype, flops, cpu, thin_dim)
        work = max(flops / rate, bytes_ / (device.mem_bw_Bps * eff["memory"]))
        return (work + table["launch_s"]) * device.time_share

    fwd = t(node.fwd_flops * loc.flop_frac, x_b + w_b + y_b, thin[0])
    skip_dx = no_input_grad(node)
    bwd_data = 0.0 if skip_dx else t(node.bwd_data_flops * loc.flop_frac, y_b + w_b + x_b + (0 if w_b else y_b),
                                     thin[1])
    bwd_weight = t(node.bwd_weight_flops * loc.flop_frac, x_b + y_b + w_b, thin[2]) if node.params else 0.0
    return OpTime(fwd, bwd_data, bwd_weight)


@dataclass(frozen=True)
class _Hit:
    """Measured seconds of one op at a local shape: a record of that shape, or derived from records of
    the same op and per-sample shapes at other batch sizes (`scale`: the batch ratio when one record
    was scaled in proportion; 1.0 otherwise)."""

    fwd_s: float
    bwd_data_s: float
    bwd_weight_s: float | None
    scale: float = 1.0
    derived: bool = False


def _times(rec: OpRecord) -> tuple[float, float, float | None]:
    return rec.fwd.median_s, rec.bwd_data.median_s, rec.bwd_weight.median_s if rec.bwd_weight else None


def _lookup(cal: Calibration, op: str, loc: LocalShapes) -> _Hit | None:
    """Exact local-shape match, else the same op and per-sample shapes at other batch sizes: with two or
    more such records, each pass's time is affine in the batch through the two nearest (interpolated
    between them, extrapolated beyond: an op's fixed cost, e.g. an LSTM's per-time-step kernels, does
    not shrink with the batch); with one, scaled in proportion to the batch (`scale`)."""
    rec = cal.ops.get(loc.key(op))
    if rec is not None:
        return _Hit(*_times(rec))
    if not loc.x or not loc.y:
        return None
    same: dict[int, OpRecord] = {}
    w = "x".join(map(str, loc.w)) if loc.w else "-"
    for other in cal.ops.values():
        if other.op != op:
            continue
        parts = dict(p.split("=", 1) for p in other.key.split("|")[1:])
        ox, oy = parts["x"].split("x"), parts["y"].split("x")
        if parts["w"] == w and ox[1:] == [str(v) for v in loc.x[1:]] and oy[1:] == [str(v) for v in loc.y[1:]]:
            same.setdefault(int(ox[0]), other)
    if not same:
        return None
    n = loc.x[0]
    if len(same) == 1:
        (nb, other), = same.items()
        return _Hit(*_times(other), scale=n / nb, derived=True)
    n1, n2 = sorted(sorted(same, key=lambda b: (abs(b - n), b))[:2])
    t1, t2 = _times(same[n1]), _times(same[n2])

    def at(a: float, b: float) -> float:
        slope = (b - a) / (n2 - n1)
        fixed = a - slope * n1
        if slope < 0 or fixed < 0:  # noise across the two records: in proportion to the nearer one
            return a * n / n1 if abs(n - n1) <= abs(n - n2) else b * n / n2
        return fixed + slope * n

    w1, w2 = t1[2], t2[2]
    return _Hit(at(t1[0], t2[0]), at(t1[1], t2[1]), None if w1 is None or w2 is None else at(w1, w2), derived=True)


def _piece_hit(cal: Calibration, node: Node, variant: str | None, fracs: tuple[float, float, float],
               loc: LocalShapes, op: str | None = None) -> tuple[_Hit | None, bool]:
    """(the time of a spatial piece with no record of its own shape, whether it is the variant's): the
    whole layer's record (cost.spatial.local_graph's SPATIAL_WHOLE_SHAPES, at the piece's samples,
    channels and filters; `hybridpar profile --model` times whole layers) scaled by the piece's share
    of the output elements, which a convolution's or pooling's FLOPs and an elementwise op's bytes
    are linear in (of the input's, for an op whose output is not cut: a global average pooling);
    `op`: the op-table name to look up (default the node's op; a channels-last or bf16 record's name);
    op_time then corrects the rate for the smaller size as for a batch-scaled record."""
    ins, out = node.attr(SPATIAL_WHOLE_SHAPES)
    whole = local_shapes(dataclasses.replace(node, in_shapes=ins, out_shape=out), *fracs)
    hit = _lookup(cal, variant, whole) if variant else None
    of_variant = hit is not None
    hit = hit or _lookup(cal, op or node.op, whole)
    if hit is None or not whole.y or not math.prod(whole.y):
        return None, False
    share = math.prod(loc.y) / math.prod(whole.y) if loc.y != whole.y or not whole.x or not math.prod(whole.x) \
        else math.prod(loc.x) / math.prod(whole.x)
    return dataclasses.replace(hit, scale=hit.scale * share, derived=True), of_variant


def variant_name(op: str, channel: int, filter_: int, input_grad: bool = True) -> str:
    """The op-table name of a conv/linear as the runtime runs it split over channel x filter
    (hybridpar.profile.dist_layers times it; `/nodx`: without the input gradient)."""
    return f"{op}@c{channel}f{filter_}" + ("" if input_grad else "/nodx")


# ops that return their 4-D input's memory format (TensorIterator and the NHWC kernels of oneDNN/cuDNN:
# a channels-last input gives a channels-last output); a convolution returns it from its weight too
_KEEPS_FORMAT = frozenset({"batchnorm", "relu", "pointwise", "add", "mul", "maxpool", "avgpool",
                           "adaptive_avgpool", "dropout", "concat"})


@dataclass(frozen=True)
class ChannelsLast:
    """Where a channels-last run (`train --channels-last`: the model's 4-D weights and inputs converted)
    computes on NHWC activations, and where it copies one back into NCHW order."""

    image: frozenset[str]  # nodes that compute on a channels-last activation (priced from "#cl" records)
    copies: dict[str, int]  # node -> elements of the channels-last activation copied where it takes it


def _is_4d(shape: tuple[int, ...]) -> bool:
    return len(shape) == 4


def channels_last_layout(graph: Graph) -> ChannelsLast:
    """`ChannelsLast` of `graph` (nodes in topological order). Channels-last are its 4-D inputs, every
    2-D convolution's output (its weight is converted), and the 4-D output of an op of `_KEEPS_FORMAT`
    that took a channels-last operand as its producer made it. A working op taking such an operand
    computes on NHWC memory (`image`); a flatten, or a view folded into its consumer (x.view(n, -1)
    before a Linear), reads it in NCHW order: a copy, except where both orders agree (one channel, or a
    1 x 1 image after a global pooling). Other 4-D tensors (attention's heads) are as PyTorch made them."""
    image: set[str] = set()
    cl_out: set[str] = set()
    copies: dict[str, int] = {}
    by_name = {n.name: n for n in graph.nodes}
    for n in graph.nodes:
        if n.op == "input":
            if _is_4d(n.out_shape):
                cl_out.add(n.name)
            continue
        cl_in = [(i, tuple(shape)) for i, shape in zip(n.inputs, n.in_shapes) if i in cl_out]
        as_made = [i for i, shape in cl_in if shape == tuple(by_name[i].out_shape)]
        moved = [by_name[i].out_shape for i, shape in cl_in if not _is_4d(shape)]
        if n.op in _FREE and not _is_4d(n.out_shape):  # a flatten/reshape node: its own copy
            moved += [by_name[i].out_shape for i in as_made]
        elif n.op == "conv2d" or (as_made and n.op not in _FREE):
            image.add(n.name)
            if n.op == "conv2d" or (n.op in _KEEPS_FORMAT and _is_4d(n.out_shape)):
                cl_out.add(n.name)
        numel = sum(math.prod(x) for x in moved if x[1] > 1 and x[2] * x[3] > 1)
        if numel:
            copies[n.name] = numel
    return ChannelsLast(frozenset(image), copies)


def format_copy_time(node: Node, numel: int, dev: DeviceSpec, dtype: str, sample_frac: float = 1.0,
                     channel_frac: float = 1.0, filter_frac: float = 1.0) -> OpTime:
    """A channels-last activation of `numel` elements (whole shape) copied into NCHW order where `node`
    takes it (`ChannelsLast.copies`), at the node's local share of its input: bytes read plus written at
    the device's memory bandwidth, forward; backward the same again, an approximation (the gradient
    comes back in NCHW order and the channels-last op before it converts it to its own format)."""
    if not numel:
        return OpTime(0.0, 0.0, 0.0)
    frac = local_shapes(node, sample_frac, channel_frac, filter_frac).x_frac
    t = 2.0 * numel * frac * DTYPE_BYTES[dtype] / dev.mem_bw_Bps * dev.time_share
    return OpTime(t, t, 0.0, "layout-copy")


def runtime_overhead_for(device: DeviceSpec,
                         calibration: Calibration | str | os.PathLike | None = None) -> RuntimeOverhead | None:
    """The calibration's RuntimeOverhead when it was measured on this device (`calibration` None: the
    default file, for CPU devices), else None: GPU presets are priced without it."""
    cal = resolve_calibration(calibration, default=device.kind == "cpu")
    return cal.runtime_overhead if cal is not None and cal.device_name == device.name else None


def layout_steps_for(device: DeviceSpec, calibration: Calibration | str | os.PathLike | None, model: str, batch: int,
                     input_shape: Sequence[int] | None, world_size: int) -> list[LayoutStep]:
    """The calibration's fake-world steps of `model` (hybridpar.profile.layout_steps) at this batch, input
    shape and world size, when it was measured on this device; else none."""
    cal = resolve_calibration(calibration, default=device.kind == "cpu")
    if cal is None or cal.device_name != device.name:
        return []
    want = (model_key(model), batch, tuple(input_shape) if input_shape else None, world_size)
    return [s for s in cal.layout_steps if s.key()[:4] == want]


def op_time(node: Node, device: DeviceSpec | Cluster, *, dtype: str = "fp32", sample_frac: float = 1.0,
            channel_frac: float = 1.0, filter_frac: float = 1.0,
            calibration: Calibration | str | os.PathLike | None = None, variant: str | None = None,
            memory_format: str = "nchw", as_model: bool = True) -> OpTime:
    """Forward / backward-data / backward-weight seconds of `node` on one device at its local shape.

    A measured time from the calibration table is used when the table was measured on this device
    (`calibration` None: the default calibration file, for CPU devices); measured times are
    single-threaded per rank, so they stretch by `device.time_share` when ranks share cores.
    `variant` names the table entry of how the runtime runs this op here, when that differs from the
    plain op (e.g. "batchnorm_global": batch norm with statistics over several sample groups);
    without a measurement of the variant, the plain op's is used.
    `memory_format` "channels_last": the node computes on a channels-last activation
    (`ChannelsLast.image`): looked up among the records timed so (`hybridpar profile --channels-last`),
    else priced as NCHW with `as_nchw` set. A bf16 node is looked up among the records timed under bf16
    autocast (`hybridpar profile --precision bf16`), never the fp32 ones: without one, the roofline.
    `as_model`: the node computes on the model's own tensors (a sample split; not a channel/filter
    layout, whose runtime gathers NCHW tensors): an NCHW node the model hands an NHWC input (NHWC_IN)
    is priced from its channels-last record where there is one."""
    if memory_format not in MEMORY_FORMATS:
        raise ValueError(f"memory_format {memory_format!r}: expected one of {', '.join(MEMORY_FORMATS)}")
    if memory_format == "nchw" and as_model and node.attr(NHWC_IN) and variant is None:
        t = _op_time(node, device, dtype, (sample_frac, channel_frac, filter_frac), calibration, None,
                     "channels_last")
        if t.source.startswith("measured"):  # else NCHW's, measured or the roofline's, as before
            return _recomputed(node, dataclasses.replace(t, as_nchw=False))
    t = _op_time(node, device, dtype, (sample_frac, channel_frac, filter_frac), calibration, variant, memory_format)
    return _recomputed(node, t)


def _recomputed(node: Node, t: OpTime) -> OpTime:
    if node.attr(RECOMPUTES_FORWARD) and t.bwd_s > 0:  # its backward runs its forward again first
        t = dataclasses.replace(t, bwd_data_s=t.bwd_data_s + t.fwd_s)
    return t


def _op_time(node: Node, device: DeviceSpec | Cluster, dtype: str, fracs: tuple[float, float, float],
             calibration: Calibration | str | os.PathLike | None, variant: str | None, memory_format: str) -> OpTime:
    sample_frac, channel_frac, filter_frac = fracs
    dev = device.device if isinstance(device, Cluster) else device
    if node.op in _FREE:
        return OpTime(0.0, 0.0, 0.0)
    cal = resolve_calibration(calibration, default=dev.kind == "cpu")
    cpu = cpu_curve(cal) if cal is not None and cal.device_name == dev.name else None
    image = memory_format != "nchw"
    if cal is not None and cal.device_name == dev.name and dtype in PRECISIONS:
        if image:
            t = _measured(cal, node, dev, fracs, variant, cpu, memory_format, dtype)
            if t is not None:
                return t
        t = _measured(cal, node, dev, fracs, variant, cpu, "nchw", dtype)
        if t is not None:
            return dataclasses.replace(t, as_nchw=image)
    t = roofline_time(node, dev, dtype=dtype, sample_frac=sample_frac, channel_frac=channel_frac,
                      filter_frac=filter_frac, cpu=cpu)
    return dataclasses.replace(t, as_nchw=image) if image else t


def chunk_time(node: Node, t: int, k: int, axis: int, device: DeviceSpec | Cluster, *, dtype: str = "fp32",
               sample_frac: float = 1.0, calibration: Calibration | str | os.PathLike | None = None) -> OpTime:
    """op_time of time chunk t of k of `node` (a recurrent layer, or a per-step op the wavefront runs chunk
    by chunk), split along the time `axis`: the op at the chunk's own shape (graph.recurrent.time_slice),
    as `hybridpar profile --model` times a layer at its chunks' steps. A chunk is not 1/k of its layer:
    measured here, a 4-layer LSTM (192 units, 32 steps, batch 32) ran 24 ms per layer whole and 29 ms in
    4 chunks (a chunk's per-call work and shorter GEMMs). Without a record of the chunk but with one of
    the whole node: the whole's time in proportion to the chunk's steps ("measured-scaled")."""
    steps = node.out_shape[axis]
    mine = chunk_steps(steps, t, k)
    own = op_time(time_slice(node, mine, axis), device, dtype=dtype, sample_frac=sample_frac, calibration=calibration)
    if own.source.startswith("measured"):
        return own
    whole = op_time(node, device, dtype=dtype, sample_frac=sample_frac, calibration=calibration)
    if not whole.source.startswith("measured"):
        return own
    f = mine / steps
    return OpTime(whole.fwd_s * f, whole.bwd_data_s * f, whole.bwd_weight_s * f, "measured-scaled")


def _measured(cal: Calibration, node: Node, dev: DeviceSpec, fracs: tuple[float, float, float],
              variant: str | None, cpu: Curve | None, memory_format: str = "nchw", precision: str = "fp32"
              ) -> OpTime | None:
    """op_time from the calibration's records of `memory_format` and `precision` (None: none fits)."""
    if record_op(node) == f"lstm*{node.attr('layers')}":
        # a unidirectional LSTM stack of 2+ layers: timed whole by the graph path, else the sum of the
        # one-layer records the hook path times (profile.ops), as the MP runtime runs it layer by layer
        whole = _measured_as(cal, node, dev, fracs, variant, cpu, memory_format, precision)
        layers = layer_nodes(node)
        parts = [t for n in layers if (t := _measured_as(cal, n, dev, fracs, variant, cpu, memory_format,
                                                         precision)) is not None]
        if len(parts) < len(layers):
            return whole
        stack = OpTime(sum(p.fwd_s for p in parts), sum(p.bwd_data_s for p in parts),
                       sum(p.bwd_weight_s for p in parts),
                       next((p.source for p in parts if "scaled" in p.source), parts[0].source))
        # an exact record first: the whole stack's, else its layers' (scaled from another batch: the whole's)
        return whole if whole is not None and ("scaled" not in whole.source or "scaled" in stack.source) else stack
    return _measured_as(cal, node, dev, fracs, variant, cpu, memory_format, precision)


def _measured_as(cal: Calibration, node: Node, dev: DeviceSpec, fracs: tuple[float, float, float],
                 variant: str | None, cpu: Curve | None, memory_format: str, precision: str) -> OpTime | None:
    """`_measured` from the one record of the node's key (graph.recurrent.record_op: its op kind)."""
    loc = local_shapes(node, *fracs)
    var = format_op(variant, memory_format, precision) if variant else None
    hit = _lookup(cal, var, loc) if var else None
    of_variant = hit is not None
    name = format_op(record_op(node), memory_format, precision)
    hit = hit or _lookup(cal, name, loc)
    if hit is None and node.attr(SPATIAL_WHOLE_SHAPES):
        hit, of_variant = _piece_hit(cal, node, var, fracs, loc, name)
    if hit is None:
        return None
    scale = hit.scale
    if scale != 1.0 and cpu is not None:  # another batch's (or the whole layer's) record: its rate here
        f = node.fwd_flops * loc.flop_frac
        scale *= curve_factor(cpu, f / scale) / curve_factor(cpu, f)
    k = scale * dev.time_share
    bw = hit.bwd_weight_s * k if hit.bwd_weight_s is not None else 0.0
    bd = 0.0 if no_input_grad(node) else hit.bwd_data_s * k
    source = "measured-scaled" if hit.derived else "measured"
    return OpTime(hit.fwd_s * k, bd, bw, f"{source}:{variant}" if of_variant else source)
