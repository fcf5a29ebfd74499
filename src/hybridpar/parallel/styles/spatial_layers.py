"""The module wrappers of spatial layouts (depth/height/width splits): what `parallelize` swaps in for
convolutions, transposed convolutions, pooling and upsampling when activations are DTensors split
over the spatial mesh dims (hybridpar.layout.placements.activation_placements: Shard(2)/Shard(3)/
Shard(4) of [N, C, *spatial]).

Each takes its DTensor input's local piece under those placements (DTensor's Shard(d) piece is
torch.chunk's, which hybridpar.layout.halo assumes), runs the op on the piece plus its halo
(hybridpar.parallel.styles.spatial: point-to-point exchange forward, halo reduction backward) and
returns its torch.chunk piece of the whole output as a DTensor with the same placements. Weights are
whole on every rank; their gradients are partial sums over the spatial pieces and the samples, summed
by the gradient sync over the grid's `stats_group` (sample x spatial ranks).

- ConvNd (any kernel, stride, padding, dilation, groups; padding_mode 'zeros'): `SpatialConv`.
- Under channel/filter splits too (G > 1): a Conv2d the channel/filter algorithm runs
  (`splits_as_conv`) is `SpatialDistConv` (halo on the channel piece, then stationary-x/y/w);
  pooling and upsampling run on the channel piece; other convolutions and transposed convolutions
  take every channel (`channel_piece = False`: DTensor gathers them on channel_filter).
- ConvTransposeNd (stride, padding, output_padding, dilation, groups): `SpatialConvTranspose`; output
  row j reads input rows i with i*stride + t*dilation = j + padding, so a rank's output piece reads an
  input window like a convolution's (`_TransposedWindow`), computed without padding and cropped.
- MaxPoolNd / AvgPoolNd (no ceil_mode; avg with count_include_pad and no divisor_override): `SpatialPool`.
- Upsample 'nearest' by integer factors: `SpatialUpsample` (`_UpsampleWindow`: output row i reads
  floor(i / s)).
- AdaptiveAvgPoolNd to size 1 along the split dims (global average pooling): `SpatialGlobalAvgPool`,
  one allreduce of per-channel sums over the spatial ranks.
- Anything else of these kinds (adaptive pools to other sizes, bilinear upsampling, ...):
  `SpatialGathered` runs the module on the spatially whole input (DTensor's allgather over the spatial
  dims) on every spatial rank; exact, at the price of the gather and a replicated computation. It
  holds no parameters (only parameter-free modules get it).
A dimension of the tensor the layout cannot split (a height split of a 1-D conv's [N, C, L]) is
computed whole on each rank of that mesh dim; the weight's gradient is then scaled by 1/(those
ranks) so that the sum over the stats group counts it once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from hybridpar.errors import UserError
from hybridpar.layout.halo import Window
from hybridpar.parallel.comm.collectives import all_reduce_
from hybridpar.parallel.mesh import Group, Meshes, ProcessGrid
from hybridpar.parallel.styles.spatial import (
    ConvOp,
    Halo,
    Sliding,
    SpatialSplit,
    halo_apply,
    halo_window,
    spatial_conv,
    spatial_pool,
)
from hybridpar.parallel.styles.table import splits_as_conv

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
CONV_TRANSPOSES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
MAX_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)
AVG_POOLS = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)
ADAPTIVE_AVG = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)
ADAPTIVE_MAX = (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
_NDIM = {c: i + 1 for group in (CONVS, CONV_TRANSPOSES, MAX_POOLS, AVG_POOLS, ADAPTIVE_AVG, ADAPTIVE_MAX)
         for i, c in enumerate(group)}


# -- windows of the ops that are not plain sliding windows -----------------------------------------

@dataclass(frozen=True)
class _TransposedWindow(Window):
    """A transposed convolution along one dim: `size` input rows; output row j reads input rows i
    with i*stride + t*dilation = j + padding (t < kernel), clipped to the input."""

    output_padding: int = 0

    @property
    def out_size(self) -> int:
        return (self.size - 1) * self.stride - 2 * self.padding + self.dilation * (self.kernel - 1) \
            + self.output_padding + 1

    def needed(self, out_start: int, out_stop: int) -> tuple[int, int]:
        if out_stop <= out_start:
            return (0, 0)
        a = max(0, -((self.dilation * (self.kernel - 1) - out_start - self.padding) // self.stride))  # ceil
        b = min(self.size, (out_stop - 1 + self.padding) // self.stride + 1)
        return (a, b) if b > a else (0, 0)

    def first_row(self, a: int) -> int:
        """Global output row of the first row conv_transpose (no padding) computes from input row a."""
        return a * self.stride - self.padding

    def rows_from(self, a: int, b: int) -> int:
        return (b - a - 1) * self.stride + self.dilation * (self.kernel - 1) + 1 if b > a else 0


@dataclass(frozen=True)
class _UpsampleWindow(Window):
    """Nearest upsampling by an integer factor (`stride`): output row i reads input row i // factor."""

    @property
    def out_size(self) -> int:
        return self.size * self.stride

    def needed(self, out_start: int, out_stop: int) -> tuple[int, int]:
        if out_stop <= out_start:
            return (0, 0)
        return (out_start // self.stride, (out_stop - 1) // self.stride + 1)

    def first_row(self, a: int) -> int:
        return a * self.stride

    def rows_from(self, a: int, b: int) -> int:
        return (b - a) * self.stride


# -- the DTensor boundary of a spatial layer ----------------------------------------------------------

_GROUPS: dict[tuple[int, str], tuple[object, Group]] = {}


def _mesh_group(meshes: Meshes, name: str) -> Group:
    """The ranks along mesh dim `name` through this rank (DeviceMesh's group), as our Group."""
    key = (id(meshes.act), name)
    hit = _GROUPS.get(key)
    if hit is None or hit[0] is not meshes.act:  # an id of a mesh that is gone (the dry run's worlds)
        mesh = meshes.act
        i = meshes.spatial.index(name) + 1
        at: list = list(mesh.get_coordinate() or [])
        index = at[i]
        at[i] = slice(None)
        ranks = tuple(int(r) for r in mesh.mesh[tuple(at)].tolist())
        hit = _GROUPS[key] = (mesh, Group(ranks, mesh.get_group(i) if len(ranks) > 1 else None, index))
    return hit[1]


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` (a weight used on a whole dimension several ranks
    compute alike: their partial gradients are copies)."""

    @staticmethod
    def forward(ctx, t, scale: float):
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def scale_grad(t: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    return t if t is None or scale == 1.0 else _ScaleGrad.apply(t, scale)


def _scaled(t: torch.Tensor, scale: float) -> torch.Tensor:
    return t if scale == 1.0 else _ScaleGrad.apply(t, scale)


class SpatialLayer(nn.Module):
    """DTensor in (any placements), local piece under the spatial boundary placements, DTensor out."""

    meshes: Meshes | None = None  # set by parallelize
    # with channel/filter splits too (G > 1): whether the op runs on this rank's channel piece (a
    # per-channel op, or the composed convolution) or needs every channel (DTensor gathers them on
    # channel_filter; computed alike on the G ranks, its output whole there)
    channel_piece = True

    def __init__(self, name: str, grid: ProcessGrid):
        super().__init__()
        self.name, self.grid = name, grid

    def forward(self, x):
        from hybridpar.parallel.dtensor.boundary import boundary_placements, from_local, runtime_code, to_local

        meshes = self.meshes
        if meshes is None:
            raise RuntimeError(f"{self.name}: a spatial layer runs inside a parallelized model only")
        with runtime_code():
            places = boundary_placements(meshes, ndim=x.dim())
            if meshes.g_size > 1 and not self.channel_piece:
                places[-1] = Replicate()
            splits, copies = [], 1
            for i, name in enumerate(meshes.spatial):
                pl = places[1 + i]
                if isinstance(pl, Shard):
                    splits.append(SpatialSplit(pl.dim, _mesh_group(meshes, name)))
                else:
                    copies *= meshes.act.size(1 + i)
            halo = Halo(tuple(sorted(splits, key=lambda s: s.dim)), tuple(x.shape[2:]), self.grid.comm_log,
                        self.name)
            y, shape = self.local(to_local(x, meshes, places), halo, 1.0 / copies, tuple(x.shape))
            return from_local(y, meshes, places, shape)

    def local(self, x: torch.Tensor, halo: Halo, grad_scale: float, shape: tuple[int, ...]):
        """(this rank's output piece, the whole output's shape)."""
        raise NotImplementedError


def _geometry(m: Any, nd: int) -> Sliding:
    pad = m.padding
    if isinstance(pad, str):
        if pad == "valid":
            pad = 0
        else:  # "same": symmetric when the receptive field is odd
            tot = [d * (k - 1) for d, k in zip(_tuple(m.dilation, nd), _tuple(m.kernel_size, nd))]
            pad = tuple(t // 2 for t in tot)
    return Sliding.of(nd, m.kernel_size, getattr(m, "stride", None), pad, getattr(m, "dilation", 1),
                      getattr(m, "groups", 1))


def _tuple(v, n: int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


def _out_shape(shape: tuple[int, ...], channels: int, windows: Sequence[Window]) -> tuple[int, ...]:
    return (shape[0], channels, *(w.out_size for w in windows))


def _geometry_attr(field: str) -> property:
    return property(lambda self: getattr(self.geom, field))


class _TorchGeometry:
    """torch's attribute names for a sliding window's geometry, read off `geom`: model code reads them
    from the module it calls (Hugging Face MobileNet's and EfficientNet's TF-style padding read
    `conv.stride` and `conv.kernel_size`), and a spatial layer replaces that module."""

    geom: Sliding
    kernel_size = _geometry_attr("kernel")
    stride = _geometry_attr("stride")
    padding = _geometry_attr("padding")
    dilation = _geometry_attr("dilation")
    groups = _geometry_attr("groups")


class SpatialConv(_TorchGeometry, SpatialLayer):
    """Conv1d/2d/3d on spatial pieces (halo exchange): weight and bias whole on every rank."""

    def __init__(self, name: str, m: Any, grid: ProcessGrid):
        super().__init__(name, grid)
        self.nd = _NDIM[type(m)]
        self.geom = _geometry(m, self.nd)
        self.weight = nn.Parameter(m.weight.detach().clone(), requires_grad=m.weight.requires_grad)
        self.bias = nn.Parameter(m.bias.detach().clone(), requires_grad=m.bias.requires_grad) \
            if m.bias is not None else None
        self.channel_piece = grid.g_size == 1  # under channel/filter: a conv SpatialDistConv does not take

    def local(self, x, halo, grad_scale, shape):
        g = self.geom
        w, b = _scaled(self.weight, grad_scale), scale_grad(self.bias, grad_scale)
        y = spatial_conv(x, w, b, g, halo)
        windows = [Window(n, g.kernel[d], g.stride[d], g.padding[d], g.dilation[d]) for d, n in enumerate(shape[2:])]
        return y, _out_shape(shape, self.weight.shape[0], windows)

    def extra_repr(self) -> str:
        return f"{self.name}: weight={tuple(self.weight.shape)} {self.geom}"


class SpatialDistConv(_TorchGeometry, SpatialLayer):
    """A Conv2d split over channel/filter and spatially at once (stationary-x/y/w on a spatial piece):
    the halo exchange extends this rank's channel piece to its output piece's window, and the
    channel/filter algorithm (hybridpar.parallel.styles.conv.DistConvFunction: gather x in the filter
    group, reduce-scatter y in the channel group) runs on that window without padding along the split
    dims. The filter and channel groups hold the same spatial piece, so their windows have one shape.
    Weight and bias hold this rank's block; their gradients are summed over the stats group."""

    def __init__(self, name: str, grid: ProcessGrid, weight: torch.Tensor, bias: torch.Tensor | None,
                 geom: Sliding, comm: Any):
        super().__init__(name, grid)
        self.geom, self.comm = geom, comm
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None

    def local(self, x, halo, grad_scale, shape):
        from hybridpar.parallel.styles.conv import ConvGeometry, DistConvFunction

        g = self.geom
        w, b = _scaled(self.weight, grad_scale), scale_grad(self.bias, grad_scale)
        ext = halo_window(x, halo.splits, g.windows(halo), log=halo.log, tag=halo.tag)
        filters = self.comm.out_sizes[self.comm.pos.g]
        empty = g.empty_out_shape(ext, filters, halo)
        if empty is not None:  # so is every rank's of its channel and filter groups (same spatial piece)
            y = _empty_out(ext, empty, w, b)
        else:
            pad, st, dil = g.local_padding(halo), g.stride, g.dilation
            geo = ConvGeometry((st[0], st[1]), (pad[0], pad[1]), (dil[0], dil[1]))
            y = DistConvFunction.apply(ext, w, geo, self.comm)
            if b is not None:
                y = y + b.view(1, -1, 1, 1)
        windows = [Window(n, g.kernel[d], g.stride[d], g.padding[d], g.dilation[d]) for d, n in enumerate(shape[2:])]
        return y, _out_shape(shape, sum(self.comm.out_sizes), windows)

    def extra_repr(self) -> str:
        p = self.comm.pos
        return f"{self.name}: P_C={p.channel} P_F={p.filter} g={p.g} weight={tuple(self.weight.shape)} {self.geom}"


def _empty_out(ext: torch.Tensor, shape: tuple[int, ...], *params: torch.Tensor | None) -> torch.Tensor:
    from hybridpar.parallel.styles.spatial import _empty_piece

    return _empty_piece(ext, shape, *params)


def _dist_conv(name: str, m: nn.Conv2d, lay, state) -> SpatialDistConv:
    """The composed layer for `m` under `lay` (channel/filter and spatial), its weight block cut as
    hybridpar.parallel.styles.table.conv_style cuts it, and where the block sits (full_state_dict)."""
    from hybridpar.layout import piece_sizes, ranges
    from hybridpar.parallel.state import ShardInfo
    from hybridpar.parallel.styles.conv import ConvComm, weight_block

    grid = state.grid
    pos = grid.pos(lay.channel, lay.filter)
    w, b = m.weight.detach(), (m.bias.detach() if m.bias is not None else None)
    in_sizes, out_sizes = piece_sizes(w.shape[1], grid.g_size), piece_sizes(w.shape[0], grid.g_size)
    comm = ConvComm(pos, tuple(in_sizes), tuple(out_sizes), grid.filter_group(lay.channel, lay.filter),
                    grid.channel_group(lay.channel, lay.filter), grid.comm_log, name)
    rows, cols = tuple(ranges(out_sizes, pos.out_piece_ids())), tuple(ranges(in_sizes, pos.in_piece_ids()))
    bias_rng = tuple(ranges(out_sizes, [pos.g]))
    bb = b[bias_rng[0][0]:bias_rng[0][0] + bias_rng[0][1]].clone() if b is not None else None
    new = SpatialDistConv(name, grid, weight_block(w, pos, in_sizes, out_sizes), bb, _geometry(m, 2), comm)
    new.weight.requires_grad_(m.weight.requires_grad)
    w_shape, b_shape = tuple(w.shape), (tuple(b.shape) if b is not None else None)
    state.shard_fns[name] = lambda: {"weight": ShardInfo(w_shape, (rows, cols)),
                                     **({"bias": ShardInfo(b_shape, (bias_rng,))} if b_shape else {})}
    return new


class SpatialPool(_TorchGeometry, SpatialLayer):
    def __init__(self, name: str, m: Any, grid: ProcessGrid):
        super().__init__(name, grid)
        self.nd = _NDIM[type(m)]
        self.kind = "max" if isinstance(m, MAX_POOLS) else "avg"
        self.geom = _geometry(m, self.nd)

    def local(self, x, halo, grad_scale, shape):
        g = self.geom
        y = spatial_pool(x, self.kind, g, halo)
        windows = [Window(n, g.kernel[d], g.stride[d], g.padding[d], g.dilation[d]) for d, n in enumerate(shape[2:])]
        return y, _out_shape(shape, shape[1], windows)


def _crop(y: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows [start, start+length) of y along dim, zeros where they fall outside y (differentiable)."""
    pad = [0, 0] * (y.dim() - 2)
    k = 2 * (y.dim() - 1 - dim)
    pad[k], pad[k + 1] = -start, start + length - y.shape[dim]
    return F.pad(y, pad) if any(pad) else y


def _windowed(x: torch.Tensor, halo: Halo, windows: Sequence[Any], out_local: list[int], op, tie=(), direct=None):
    """op(this rank's window of x) cropped to its output rows along each split dim: `windows[d]` (an
    _UpsampleWindow or _TransposedWindow per spatial dim) maps the window's input rows to global output
    rows. `direct()`: the same op through hybridpar.parallel.styles.spatial.halo_apply (None where it
    does not apply), which keeps only the piece and its halo rows for backward, not the window."""
    from hybridpar.layout.halo import halo_plan

    split_windows = [windows[s.dim - 2] for s in halo.splits]
    y = direct() if direct is not None else None
    if y is None:
        ext = halo_window(x, halo.splits, split_windows, log=halo.log, tag=halo.tag)
    rows = []
    for s in halo.splits:
        w = windows[s.dim - 2]
        plan = halo_plan(w, s.group.size)
        a, b = plan.window[s.group.index]
        o0, o1 = plan.out_piece(s.group.index)
        rows.append((s.dim, a, b, o0, o1, w))
    if y is None and any(b <= a for _, a, b, *_ in rows):  # no input reaches this rank's output rows
        shape = list(out_local)
        zero = ext.sum() * 0
        for t in tie:
            if t is not None:
                zero = zero + t.sum() * 0
        return ext.new_zeros(shape) + zero
    if y is None:
        y = op(ext)
    for dim, a, _b, o0, o1, w in rows:
        y = _crop(y, dim, o0 - w.first_row(a), o1 - o0)
    return y


class SpatialConvTranspose(SpatialLayer):
    channel_piece = False  # every input channel reaches every output channel

    def __init__(self, name: str, m: Any, grid: ProcessGrid):
        super().__init__(name, grid)
        self.nd = _NDIM[type(m)]
        nd = self.nd
        self.stride, self.padding = _tuple(m.stride, nd), _tuple(m.padding, nd)
        self.dilation, self.output_padding = _tuple(m.dilation, nd), _tuple(m.output_padding, nd)
        self.groups = m.groups
        self.weight = nn.Parameter(m.weight.detach().clone(), requires_grad=m.weight.requires_grad)
        self.bias = nn.Parameter(m.bias.detach().clone(), requires_grad=m.bias.requires_grad) \
            if m.bias is not None else None

    def local(self, x, halo, grad_scale, shape):
        k = self.weight.shape[2:]
        windows = [_TransposedWindow(n, k[d], self.stride[d], self.padding[d], self.dilation[d], self.output_padding[d])
                   for d, n in enumerate(shape[2:])]
        split = {s.dim - 2 for s in halo.splits}
        pad = [0 if d in split else p for d, p in enumerate(self.padding)]
        opad = [0 if d in split else p for d, p in enumerate(self.output_padding)]
        w, b = _scaled(self.weight, grad_scale), scale_grad(self.bias, grad_scale)
        channels = int(self.weight.shape[1]) * self.groups
        out_local = [x.shape[0], channels]
        for d, wd in enumerate(windows):
            if d in split:
                s = next(s for s in halo.splits if s.dim - 2 == d)
                from hybridpar.layout.halo import halo_plan

                o0, o1 = halo_plan(wd, s.group.size).out_piece(s.group.index)
                out_local.append(o1 - o0)
            else:
                out_local.append(wd.out_size)
        op = ConvOp(self.stride, tuple(pad), self.dilation, self.groups, transposed=True, output_padding=tuple(opad))
        y = _windowed(x, halo, windows, out_local, lambda e: op.run(e, w, None), (w,),
                      lambda: halo_apply(x, halo, [windows[s.dim - 2] for s in halo.splits], op, w))
        if b is not None:
            y = y + b.view(1, -1, *([1] * self.nd))
        return y, _out_shape(shape, channels, windows)


class SpatialUpsample(SpatialLayer):
    """nn.Upsample, mode 'nearest', integer scale factors."""

    def __init__(self, name: str, m: nn.Upsample, grid: ProcessGrid, nd: int):
        super().__init__(name, grid)
        self.factors = tuple(int(f) for f in _tuple(m.scale_factor, nd))

    def local(self, x, halo, grad_scale, shape):
        windows = [_UpsampleWindow(n, 1, f) for n, f in zip(shape[2:], self.factors)]
        out_local = [x.shape[0], x.shape[1]]
        split = {s.dim - 2: s for s in halo.splits}
        for d, wd in enumerate(windows):
            if d in split:
                from hybridpar.layout.halo import halo_plan

                o0, o1 = halo_plan(wd, split[d].group.size).out_piece(split[d].group.index)
                out_local.append(o1 - o0)
            else:
                out_local.append(wd.out_size)
        factors = tuple(float(f) for f in self.factors)
        # nearest upsampling keeps nothing for backward: its window is freed after forward anyway
        y = _windowed(x, halo, windows, out_local, lambda e: F.interpolate(e, scale_factor=factors, mode="nearest"))
        return y, _out_shape(shape, shape[1], windows)


class _SpatialSum(torch.autograd.Function):
    """Sum over the spatial ranks (forward); the gradient of the (replicated) sum is the piece's."""

    @staticmethod
    def forward(ctx, t, group: Group, log, tag: str):
        out = t.clone()
        all_reduce_(out, group, log, f"{tag}:fwd")
        return out

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None


class SpatialGlobalAvgPool(SpatialLayer):
    """AdaptiveAvgPoolNd whose output is 1 along every split dim: per-channel sums of the piece over
    the split dims, one allreduce over the spatial ranks, divided by the whole dims' size; the dims
    not split are pooled locally as the module would. The output is whole on the spatial dims."""

    def __init__(self, name: str, m: Any, grid: ProcessGrid):
        super().__init__(name, grid)
        self.nd = _NDIM[type(m)]
        self.output_size = _tuple(m.output_size, self.nd)
        self.gathered = SpatialGathered(name, m, grid)

    def forward(self, x):
        from hybridpar.parallel.dtensor.boundary import boundary_placements, from_local, runtime_code, to_local

        meshes = self.meshes
        assert meshes is not None
        places = boundary_placements(meshes, ndim=x.dim())
        dims = [pl.dim for pl in places[1:1 + len(meshes.spatial)] if isinstance(pl, Shard)]
        if len(dims) != len(meshes.spatial):  # a split the tensor has no dim for: the spatial sum would repeat
            self.gathered.meshes = meshes
            return self.gathered(x)
        with runtime_code():
            xl = to_local(x, meshes, places)
            s = xl.sum(dims, keepdim=True)
            s = _SpatialSum.apply(s, self.grid.spatial_group, self.grid.comm_log, self.name)
            s = s / math.prod(x.shape[d] for d in dims)
            size: Any = [1 if d + 2 in dims else o for d, o in enumerate(self.output_size)]
            size = [n if o is None else o for n, o in zip(x.shape[2:], size)]
            y = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}[self.nd](s, size)
            out = [*places[:1], *[Replicate()] * len(meshes.spatial), *places[1 + len(meshes.spatial):]]
            return from_local(y, meshes, out, (x.shape[0], x.shape[1], *size))


class SpatialGathered(SpatialLayer):
    """A parameter-free module run on the spatially whole input on every spatial rank (see the doc)."""

    def __init__(self, name: str, m: Any, grid: ProcessGrid):
        super().__init__(name, grid)
        self.inner = m

    def forward(self, x):
        from hybridpar.parallel.dtensor.boundary import from_local, runtime_code, to_local

        meshes = self.meshes
        assert meshes is not None
        k = len(meshes.spatial)
        places = [x.placements[0], *[Replicate()] * k, *x.placements[1 + k:]]
        with runtime_code():
            y = self.inner(to_local(x, meshes, places))
            return from_local(y, meshes, places, (x.shape[0], *y.shape[1:]))


# -- which modules, and the refusals ------------------------------------------------------------------

def spatial_refusal(m: nn.Module) -> str | None:
    """Why `m` cannot run under a spatial layout (None: it can, with one of the wrappers above or
    through DTensor)."""
    kind = type(m).__name__
    if isinstance(m, CONVS + CONV_TRANSPOSES):
        if m.padding_mode != "zeros":
            return f"{kind} with padding_mode={m.padding_mode!r} (only zeros padding is exchanged)"
        if isinstance(m.padding, str) and m.padding == "same" and any(
                d * (k - 1) % 2 for d, k in zip(_tuple(m.dilation, 3), _tuple(m.kernel_size, 3))):
            return f"{kind} with padding='same' and an even receptive field"
        return None
    if isinstance(m, MAX_POOLS + AVG_POOLS):
        if m.ceil_mode:
            return f"{kind} with ceil_mode=True"
        if isinstance(m, MAX_POOLS) and m.return_indices:
            return f"{kind} with return_indices=True"
        if isinstance(m, AVG_POOLS) and (not m.count_include_pad or getattr(m, "divisor_override", None)):
            return f"{kind} with count_include_pad=False or a divisor_override"
        return None
    if isinstance(m, (nn.SyncBatchNorm, nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d,
                      nn.InstanceNorm3d, nn.LocalResponseNorm)):
        return f"{kind} (its statistics span the spatial pieces; only BatchNorm has global statistics here)"
    return None


def spatial_wraps(m: nn.Module) -> bool:
    """Whether `spatial_style` has a wrapper for `m` (exact types: a subclass may override forward)."""
    return type(m) in _NDIM or type(m) is nn.Upsample


def spatial_style(name: str, m: nn.Module, lay, state):
    """The spatial wrapper for `m` under a spatial layout, or None (it runs through DTensor)."""
    grid = state.grid
    if type(m) is nn.Conv2d and grid.g_size > 1 and lay.g_size > 1 and splits_as_conv(m):
        return _dist_conv(name, m, lay, state)
    if type(m) in CONVS:
        return SpatialConv(name, m, grid)
    if type(m) in CONV_TRANSPOSES:
        return SpatialConvTranspose(name, m, grid)
    if type(m) in MAX_POOLS + AVG_POOLS:
        return SpatialPool(name, m, grid)
    if type(m) in ADAPTIVE_AVG and all(o == 1 for o in _tuple(m.output_size, _NDIM[type(m)])):
        return SpatialGlobalAvgPool(name, m, grid)
    if type(m) in ADAPTIVE_AVG + ADAPTIVE_MAX:
        return SpatialGathered(name, m, grid)
    if type(m) is nn.Upsample:
        f = m.scale_factor
        if m.mode == "nearest" and m.size is None and f is not None \
                and all(float(v).is_integer() for v in (f if isinstance(f, tuple) else (f,))):
            nd = len(f) if isinstance(f, tuple) else None
            return _LazyUpsample(name, m, grid, nd)
        return SpatialGathered(name, m, grid)
    return None


class _LazyUpsample(SpatialLayer):
    """nn.Upsample does not know its input's dims until it sees one: the wrapper is made then."""

    def __init__(self, name: str, m: nn.Upsample, grid: ProcessGrid, nd: int | None):
        super().__init__(name, grid)
        self.m, self.nd = m, nd
        self._by_nd: dict[int, SpatialUpsample] = {}

    def forward(self, x):
        nd = x.dim() - 2
        if self.nd is not None and nd != self.nd:
            raise UserError(f"{self.name}: Upsample with {self.nd} scale factors on a {nd}-D input")
        up = self._by_nd.get(nd)
        if up is None:
            up = self._by_nd[nd] = SpatialUpsample(self.name, self.m, self.grid, nd)
        up.meshes = self.meshes
        return up(x)


SPATIAL_LAYER_TYPES = (SpatialLayer,)
