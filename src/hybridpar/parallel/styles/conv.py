"""Distributed convolution (Dryden et al., SC19) as an autograd Function with explicit collectives.

One function covers the three algorithms on a P_C x P_F grid (see hybridpar.layout.GridPos):
  forward:  x_g  = allgather(x_loc) in the filter group       (stationary-y / -w; no-op when P_F = 1)
            y_p  = conv(x_g, w_loc)                            (partial sums over this rank's channels)
            y    = reduce_scatter(y_p) in the channel group    (stationary-x / -w; no-op when P_C = 1)
  backward: dy_p = allgather(dy) in the channel group
            dw   = conv_bwd_weight(x_g, dy_p)                  (x_g kept from forward)
            dx   = reduce_scatter(conv_bwd_data(w_loc, dy_p)) in the filter group
Uneven channel/filter counts are supported (pieces differ by at most one; empty pieces allowed).
A Linear layer is the same computation with a 1x1 kernel (channel = row-, filter = column-parallel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.layout import GridPos, Split, ranges
from hybridpar.parallel.comm.collectives import all_gather_dim, reduce_scatter_dim
from hybridpar.parallel.comm.log import CommLog
from hybridpar.parallel.mesh import Group
from hybridpar.parallel.styles.redistribute import redistribute


@dataclass(frozen=True)
class ConvGeometry:
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)

    def out_hw(self, h: int, w: int, kh: int, kw: int) -> tuple[int, int]:
        def one(n, k, s, p, d):
            return (n + 2 * p - d * (k - 1) - 1) // s + 1
        return (one(h, kh, self.stride[0], self.padding[0], self.dilation[0]),
                one(w, kw, self.stride[1], self.padding[1], self.dilation[1]))


@dataclass(frozen=True)
class ConvComm:
    """Static per-layer communication plan."""

    pos: GridPos
    in_sizes: tuple[int, ...]  # boundary pieces of the input channels (P of them)
    out_sizes: tuple[int, ...]  # boundary pieces of the output filters
    filter_group: Group
    channel_group: Group
    log: CommLog
    name: str

    @property
    def gather_sizes(self) -> list[int]:
        return [self.in_sizes[k] for k in self.pos.in_piece_ids()]

    @property
    def row_sizes(self) -> list[int]:
        return [self.out_sizes[k] for k in self.pos.out_piece_ids()]


def _local_conv(x: torch.Tensor, w: torch.Tensor, geo: ConvGeometry) -> torch.Tensor:
    if x.shape[1] == 0 or w.shape[0] == 0:  # empty shard: aten's conv mis-shapes 0-channel inputs
        oh, ow = geo.out_hw(x.shape[2], x.shape[3], w.shape[2], w.shape[3])
        return x.new_zeros(x.shape[0], w.shape[0], oh, ow)
    return F.conv2d(x, w, None, geo.stride, geo.padding, geo.dilation)


class DistConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_loc, w_loc, geo: ConvGeometry, comm: ConvComm):
        xg = all_gather_dim(x_loc, 1, comm.filter_group, comm.gather_sizes, comm.log, f"{comm.name}:fwd")
        y_part = _local_conv(xg, w_loc, geo)
        y = reduce_scatter_dim(y_part, 1, comm.channel_group, comm.row_sizes, comm.log, f"{comm.name}:fwd")
        ctx.save_for_backward(xg, w_loc)
        ctx.geo, ctx.comm = geo, comm
        return y

    @staticmethod
    def backward(ctx, dy):
        xg, w_loc = ctx.saved_tensors
        geo, comm = ctx.geo, ctx.comm
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy_p = all_gather_dim(dy.contiguous(), 1, comm.channel_group, comm.row_sizes, comm.log,
                              f"{comm.name}:bwd")
        if w_loc.numel() == 0:  # empty shard: nothing flows through it (aten rejects 0 filters)
            dxg, dw0 = torch.zeros_like(xg), torch.zeros_like(w_loc)
            dx0 = reduce_scatter_dim(dxg, 1, comm.filter_group, comm.gather_sizes, comm.log,
                                     f"{comm.name}:bwd") if need_dx else None
            return dx0, dw0, None, None
        # under autocast the forward ran in a lower precision (dy arrives in it): so does the
        # backward, as autocast's own conv backward does; gradients go back in the inputs' dtypes
        low = dy_p.dtype
        args = (list(geo.stride), list(geo.padding), list(geo.dilation), False, [0, 0], 1)
        xl, wl = xg.to(low), w_loc.to(low)
        pending = None
        dw: torch.Tensor | None = None
        if need_dx:  # the input gradient first: its reduce-scatter runs while the weight gradient computes
            dxg = torch.ops.aten.convolution_backward(dy_p, xl, wl, None, *args, [True, False, False])[0]
            pending = reduce_scatter_dim(dxg.to(xg.dtype), 1, comm.filter_group, comm.gather_sizes, comm.log,
                                         f"{comm.name}:bwd", async_op=True)
        if need_dw:
            dw = torch.ops.aten.convolution_backward(dy_p, xl, wl, None, *args, [False, True, False])[1]
            dw = dw.to(w_loc.dtype)
        dx = pending.wait() if pending is not None else None
        return dx, dw, None, None


def conv_geometry(conv: nn.Conv2d) -> ConvGeometry:
    """Numeric geometry of a Conv2d; string paddings are resolved (odd 'same' padding is rejected)."""
    pad = conv.padding
    if isinstance(pad, str):
        if pad == "valid":
            pad = (0, 0)
        else:  # "same"
            tot = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
            if any(t % 2 for t in tot):
                from hybridpar.errors import UserError

                raise UserError("padding='same' with an even receptive field is not supported distributed")
            pad = tuple(t // 2 for t in tot)
    return ConvGeometry(_pair(conv.stride), _pair(pad), _pair(conv.dilation))


def _pair(v) -> tuple[int, int]:
    a, b = v
    return int(a), int(b)


class DistConv2d(nn.Module):
    """A Conv2d whose weight holds this rank's block; input and output are channel-split.

    With `boundary` = (model's Split, this layer's Split) differing, the layer redistributes its input
    from the model's layout into its own and its output back (a layer whose layout differs from the
    plan's default), so the surrounding layers never see its layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, geo: ConvGeometry, comm: ConvComm,
                 boundary: tuple[Split, Split] | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.geo, self.comm, self.boundary = geo, comm, boundary

    meshes = None  # hybridpar.parallel.dtensor.boundary.Meshes, set by parallelize: DTensor in, DTensor out

    # nn.Conv2d's geometry, for model code that reads it from the layer (HF MobileNet's TF padding)
    stride = property(lambda self: self.geo.stride)
    padding = property(lambda self: self.geo.padding)
    dilation = property(lambda self: self.geo.dilation)
    kernel_size = property(lambda self: tuple(self.weight.shape[2:]))
    groups, padding_mode = 1, "zeros"

    def forward(self, x):
        if self.meshes is None:  # local pieces in and out (layer-level use without global semantics)
            return self._local_forward(x)
        from hybridpar.parallel.dtensor.boundary import boundary_placements, from_local, runtime_code, to_local

        with runtime_code():
            places = boundary_placements(self.meshes)
            n, _, h, w = x.shape
            y = self._local_forward(to_local(x, self.meshes, places))
            oh, ow = self.geo.out_hw(h, w, *self.weight.shape[2:])
            return from_local(y, self.meshes, places, (n, sum(self.comm.out_sizes), oh, ow))

    def _local_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.boundary is not None:
            outer, own = self.boundary
            n = x.shape[0] * outer.sample
            x = redistribute(x, n, sum(self.comm.in_sizes), outer, own, self.comm.log, f"{self.comm.name}:in")
        y = DistConvFunction.apply(x, self.weight, self.geo, self.comm)
        if self.bias is not None:
            y = y + self.bias.view(1, -1, 1, 1)
        if self.boundary is not None:
            y = redistribute(y, n, sum(self.comm.out_sizes), own, outer, self.comm.log, f"{self.comm.name}:out")
        return y

    def extra_repr(self) -> str:
        p = self.comm.pos
        return f"{self.comm.name}: P_C={p.channel} P_F={p.filter} g={p.g} weight={tuple(self.weight.shape)}"


class DistLinear(nn.Module):
    """A Linear on [..., in] as a 1x1 distributed convolution over the flattened leading dims. Its
    input features are split like a producer's channels (G pieces of in_features), its outputs into
    G pieces of out_features; with global semantics (`meshes` set) the features are the last dim of
    the DTensor and every leading dim but the sample dim is whole on each rank."""

    meshes = None

    def __init__(self, full_weight: torch.Tensor, full_bias: torch.Tensor | None, pos: GridPos,
                 filter_group: Group, channel_group: Group, log: CommLog, name: str):
        super().__init__()
        from hybridpar.layout import piece_sizes

        self.out_sizes = tuple(piece_sizes(full_weight.shape[0], pos.size))
        self.in_sizes = tuple(piece_sizes(full_weight.shape[1], pos.size))
        self.pos, self.name = pos, name
        self.comm = ConvComm(pos, self.in_sizes, self.out_sizes, filter_group, channel_group, log, name)
        self.weight = nn.Parameter(weight_block(full_weight, pos, self.in_sizes, self.out_sizes))
        self.bias = None
        if full_bias is not None:
            self.bias = nn.Parameter(full_bias[piece_slice(self.out_sizes, pos.g)].clone())

    def _local_forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        w4 = self.weight.view(*self.weight.shape, 1, 1)
        m = math.prod(lead)  # explicit: a rank's feature piece may be empty
        y = DistConvFunction.apply(x.reshape(m, x.shape[-1], 1, 1), w4, ConvGeometry(), self.comm)
        y = y.reshape(*lead, y.shape[1])
        if self.bias is not None:
            y = y + self.bias
        return y

    def forward(self, x):
        if self.meshes is None:
            return self._local_forward(x)
        from hybridpar.parallel.dtensor.boundary import boundary_placements, from_local, runtime_code, to_local

        if x.dim() < 2:
            from hybridpar.errors import UserError

            raise UserError(f"{self.name}: a channel/filter-parallel Linear needs a batched input, got "
                            f"{x.dim()}-D")
        with runtime_code():
            places = boundary_placements(self.meshes, x.dim() - 1)
            y = self._local_forward(to_local(x, self.meshes, places))
            return from_local(y, self.meshes, places, (*x.shape[:-1], sum(self.out_sizes)))


def piece_slice(sizes, k: int) -> slice:
    off = sum(sizes[:k])
    return slice(off, off + sizes[k])


def weight_block(full: torch.Tensor, pos: GridPos, in_sizes, out_sizes) -> torch.Tensor:
    """This rank's block of a [F, C, ...] weight: rows = its filter pieces (strided over the grid),
    columns = its channel pieces (all columns when in_sizes is None)."""
    rows = torch.cat([full[o:o + n] for o, n in ranges(out_sizes, pos.out_piece_ids())], 0)
    if in_sizes is None:
        return rows.contiguous()
    return torch.cat([rows[:, o:o + n] for o, n in ranges(in_sizes, pos.in_piece_ids())], 1).contiguous()
