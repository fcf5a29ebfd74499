"""Spatial parallelism (Dryden et al., IPDPS'19): a sample's depth/height/width split over ranks, each
convolution or pooling run on the rank's piece plus the halo rows its window reaches into the
neighbours' pieces.

Forward: every rank sends each other rank the rows of its piece that rank's output window reads
(hybridpar.layout.halo.halo_plan: usually a few rows to each neighbour; more ranks when pieces are
smaller than the halo), pads at the tensor's edges by itself, and runs the op with no padding along
the split dimensions: its output rows are exactly its torch.chunk piece of the global output.
Backward: the gradient of the extended window goes back the same way and is summed into the owner's
piece (the halo reduction); weight and bias gradients are partial sums over the spatial group, summed
there by the gradient sync as for any parameter replicated over a mesh dimension.

Convolutions, transposed convolutions and pooling run through `_HaloOp`, which keeps for backward
only the rank's piece (its producer's storage: no copy) and the halo rows it received, never the
window: backward re-assembles the window from them (no second exchange), runs the op's backward on it
(aten.convolution_backward; pooling recomputed, so max pooling keeps no indices) and sums the window's
gradient into the owners' pieces. Kept windows made a rank under height=2 hold about as much as one
whole process (measured: tests/cost/test_spatial_memory.py, benchmarks/bench_memory.py --spatial).
A convolution overlaps its exchange with its interior (`_interior_conv`): the sends and receives
are posted, the output rows that read only the rank's own rows are computed, then the exchange is
waited for and the boundary rows are computed from the extended window (`_boundary_conv`; forward:
the backward's halo reduction is blocking). Where no rank sends another any row (a 2x2 stride-2
pool on even pieces) the window is a view of the piece (`halo_window`).

Written here rather than taken from torch: DTensor's own convolution (`_tp_conv`) shards width only,
on a 1-D world mesh, with stride 1 when padded; LLNL's DistConv's halo send is refused by gloo.
Point-to-point on contiguous buffers is what both gloo and NCCL accept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from hybridpar.layout.halo import HaloPlan, Window, halo_plan
from hybridpar.parallel.comm.log import CommLog
from hybridpar.parallel.mesh import Group


@dataclass(frozen=True)
class SpatialSplit:
    """One split tensor dimension: `dim` of the activation (2.. for N C D H W), `group` the ranks
    splitting it (rank `group.index` holds torch.chunk piece `group.index`)."""

    dim: int
    group: Group


@dataclass
class _Pending:
    """A posted exchange: the receive buffers (per peer, None: nothing), the works, the bytes sent."""

    got: list[torch.Tensor | None]
    works: list
    sent: int
    group_size: int
    tag: str


def _post(sends: list[torch.Tensor | None], recv_shapes: list[tuple[int, ...] | None], like: torch.Tensor,
          group: Group, tag: str) -> _Pending:
    """Non-blocking point-to-point: sends[q] to rank q of the group, a tensor of recv_shapes[q] from
    rank q (None: nothing), on contiguous buffers (what gloo and NCCL both accept)."""
    ops: list[dist.P2POp] = []
    got: list[torch.Tensor | None] = []
    sent = 0
    for q in range(group.size):
        s = sends[q]
        if s is not None and s.numel() and q != group.index:
            ops.append(dist.P2POp(dist.isend, s.contiguous(), group.ranks[q], group.pg))
            sent += s.numel() * s.element_size()
    for q in range(group.size):
        shape = recv_shapes[q]
        if shape is None or q == group.index:
            got.append(None)
            continue
        if 0 in shape:  # rows of an empty cross-section (a piece empty along another split dim): no message
            got.append(like.new_empty(shape))
            continue
        buf = like.new_empty(shape)
        ops.append(dist.P2POp(dist.irecv, buf, group.ranks[q], group.pg))
        got.append(buf)
    works = [] if like.is_meta or not ops else list(dist.batch_isend_irecv(ops))
    return _Pending(got, works, sent, group.size, tag)


def _wait(works: list) -> None:
    """Where a rank blocks on a halo exchange (one place: tests/parallel/test_spatial_overlap.py
    records when it returns)."""
    for work in works:
        work.wait()


def _finish(p: _Pending, log: CommLog, meta: bool) -> list[torch.Tensor | None]:
    """Wait for a posted exchange; logged as the bytes this rank sends (the halo's kind, 'halo')."""
    if meta:  # the dry run (hybridpar.parallel.check): shapes only, point-to-point has no meta backend
        log.record("halo", p.group_size, p.sent, p.tag)
        return p.got
    with log.timed("halo", p.group_size, p.sent, p.tag):
        _wait(p.works)
    return p.got


def _transfer(sends: list[torch.Tensor | None], recv_shapes: list[tuple[int, ...] | None], like: torch.Tensor,
              group: Group, log: CommLog, tag: str) -> list[torch.Tensor | None]:
    """_post then _finish."""
    return _finish(_post(sends, recv_shapes, like, group, tag), log, like.is_meta)


def _rows(t: torch.Tensor, dim: int, rows: tuple[int, int], base: int) -> torch.Tensor:
    """Global rows [start, stop) of `t`, whose first row is global row `base`."""
    start, stop = rows
    return t.narrow(dim, start - base, stop - start)


def _assemble(x: torch.Tensor, dim: int, plan: HaloPlan, me: int, got: Sequence[torch.Tensor | None],
              pad_value: float) -> torch.Tensor:
    """This rank's window along `dim`: its edge padding, then the rows each rank sends it in rank order
    (its own from `x`, the others' as received in `got`), a new tensor."""
    shape = list(x.shape)
    base = plan.in_piece(me)[0]
    parts = []
    before, after = plan.pad[me]
    if before:
        parts.append(x.new_full(tuple(shape[:dim] + [before] + shape[dim + 1:]), pad_value))
    for q in range(plan.parts):  # the window's rows in order: they come from ranks in order
        a, b = plan.sends[q][me]
        if b > a:
            g = _rows(x, dim, (a, b), base) if q == me else got[q]
            assert g is not None  # rows[q][me] non-empty: received
            parts.append(g)
    if after:
        parts.append(x.new_full(tuple(shape[:dim] + [after] + shape[dim + 1:]), pad_value))
    if not parts:
        return x.narrow(dim, 0, 0).clone()
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0].clone()


def _reduce(grad: torch.Tensor, dim: int, plan: HaloPlan, group: Group, x_shape: tuple[int, ...], log: CommLog,
            tag: str) -> torch.Tensor:
    """The halo reduction: the gradient of this rank's window along `dim` back to the owners of its
    rows (point-to-point), summed into the gradient of this rank's piece (shape `x_shape`)."""
    me = group.index
    win_start = plan.window[me][0]  # global row of the window's first row (a padding row at the edge)

    def piece(q: int):
        a, b = plan.sends[q][me]
        return None if b <= a else grad.narrow(dim, a - win_start, b - a)

    back = [None if q == me else piece(q) for q in range(plan.parts)]
    shape = list(x_shape)

    def rows_shape(q: int):
        a, b = plan.sends[me][q]
        return None if b <= a else tuple(shape[:dim] + [b - a] + shape[dim + 1:])

    got = _transfer(back, [rows_shape(q) for q in range(plan.parts)], grad, group, log, f"{tag}:bwd")
    dx = grad.new_zeros(x_shape)
    base = plan.in_piece(me)[0]
    own = piece(me)
    if own is not None:
        _rows(dx, dim, plan.sends[me][me], base).add_(own)
    for q in range(plan.parts):  # summed in rank order: the same bits on every run
        g = got[q]
        if g is not None:
            _rows(dx, dim, plan.sends[me][q], base).add_(g)
    return dx


class _HaloExchange(torch.autograd.Function):
    """x (this rank's piece along `dim`) -> the window its output piece reads, edges padded with
    `pad_value`; backward sums the window's gradient back into the owners' pieces."""

    @staticmethod
    def forward(ctx, x, dim: int, plan: HaloPlan, group: Group, pad_value: float, log: CommLog, tag: str,
                pending: _Pending | None = None):
        if pending is None:
            pending = _post_window(x, dim, plan, group, tag)
        got = _finish(pending, log, x.is_meta)
        ctx.meta = (dim, plan, group, log, tag, tuple(x.shape))
        return _assemble(x, dim, plan, group.index, got, pad_value)

    @staticmethod
    def backward(ctx, grad):
        dim, plan, group, log, tag, x_shape = ctx.meta
        return _reduce(grad, dim, plan, group, x_shape, log, tag), None, None, None, None, None, None, None


def _post_window(x: torch.Tensor, dim: int, plan: HaloPlan, group: Group, tag: str) -> _Pending:
    """Post the forward exchange of `plan` for this rank's piece `x` (its rows the others' windows read)."""
    me = group.index
    base = plan.in_piece(me)[0]
    with torch.no_grad():
        sends = [None if q == me or plan.sends[me][q][1] <= plan.sends[me][q][0]
                 else _rows(x, dim, plan.sends[me][q], base) for q in range(plan.parts)]
    shape = list(x.shape)

    def rows_shape(q: int):
        a, b = plan.sends[q][me]
        if b <= a:
            return None
        return tuple(shape[:dim] + [b - a] + shape[dim + 1:])

    return _post(sends, [rows_shape(q) for q in range(plan.parts)], x, group, f"{tag}:fwd")


def halo_window(x: torch.Tensor, splits: Sequence[SpatialSplit], windows: Sequence[Window], *,
                pad_value: float = 0.0, log: CommLog | None = None, tag: str = "") -> torch.Tensor:
    """This rank's piece of `x` extended to the input window of its output piece along every split
    dimension (one exchange per dimension, in order, so corners travel through the later ones)."""
    log = log if log is not None else CommLog()
    for split, w in zip(splits, windows):
        plan = halo_plan(w, split.group.size)
        if _local_only(plan):  # a view of the piece (padded at the edges): no copy, nothing to exchange
            me = split.group.index
            rows = plan.sends[me][me]
            x = _rows(x, split.dim, rows, plan.in_piece(me)[0]) if rows[1] > rows[0] else x.narrow(split.dim, 0, 0)
            x = _zero_pad(x, split.dim, *plan.pad[me], value=pad_value)
            continue
        x = _HaloExchange.apply(x, split.dim, plan, split.group, pad_value, log, tag)
    return x


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _per_dim(v, n: int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


@dataclass(frozen=True)
class Halo:
    """Where a spatially split op's input lives: the split dims with their groups, the whole input's
    spatial sizes (N C *spatial without N and C), and the log its exchanges are recorded in."""

    splits: tuple[SpatialSplit, ...]
    global_sizes: tuple[int, ...]
    log: CommLog = field(default_factory=CommLog)
    tag: str = ""


@dataclass(frozen=True)
class Sliding:
    """A sliding window op's geometry per spatial dim: kernel, stride, padding, dilation (and a
    convolution's groups), as torch's modules hold them."""

    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int = 1

    @classmethod
    def of(cls, nd: int, kernel, stride=None, padding=0, dilation=1, groups: int = 1) -> Sliding:
        if isinstance(padding, str):
            raise ValueError("string padding ('same'/'valid') on a spatially split op: give numbers")
        return cls(_per_dim(kernel, nd), _per_dim(stride if stride is not None else kernel, nd),
                   _per_dim(padding, nd), _per_dim(dilation, nd), groups)

    def windows(self, halo: Halo) -> list[Window]:
        return [Window(halo.global_sizes[s.dim - 2], self.kernel[s.dim - 2], self.stride[s.dim - 2],
                       self.padding[s.dim - 2], self.dilation[s.dim - 2]) for s in halo.splits]

    def local_padding(self, halo: Halo) -> tuple[int, ...]:
        """The op's padding on the extended piece: none along the split dims (the window carries it)."""
        split = {s.dim - 2 for s in halo.splits}
        return tuple(0 if d in split else p for d, p in enumerate(self.padding))

    def empty_out_shape(self, ext: torch.Tensor, channels: int, halo: Halo) -> tuple[int, ...] | None:
        """The output shape when this rank's piece of the output is empty along a split dim, else None."""
        split = {s.dim for s in halo.splits}
        if all(ext.shape[d] for d in split):
            return None
        # per dim: an empty split dim gives 0 rows, the others as the op computes them (a piece may be
        # empty along one split dim and not along another: its shape must still be its own)
        pad = self.local_padding(halo)
        sizes = [Window(ext.shape[d + 2], self.kernel[d], self.stride[d], pad[d], self.dilation[d]).out_size
                 for d in range(len(self.kernel))]
        return (ext.shape[0], channels, *sizes)


def spatial_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, geom: Sliding,
                 halo: Halo) -> torch.Tensor:
    """convNd of a spatially split input: `x` is this rank's piece (N, C, *spatial); returns this rank's
    torch.chunk piece of the whole output along the split dimensions (whole along the others)."""
    windows = geom.windows(halo)
    op = ConvOp(geom.stride, geom.local_padding(halo), geom.dilation, geom.groups, geom=geom, windows=tuple(windows))
    y = halo_apply(x, halo, windows, op, weight, bias)
    if y is not None:
        return y
    ext = halo_window(x, halo.splits, windows, log=halo.log, tag=halo.tag)
    empty = geom.empty_out_shape(ext, weight.shape[0], halo)
    if empty is not None:
        return _empty_piece(ext, empty, weight, bias)
    return _CONV[weight.dim() - 2](ext, weight, bias, geom.stride, geom.local_padding(halo), geom.dilation,
                                   geom.groups)


@dataclass(frozen=True)
class ConvOp:
    """A (transposed) convolution on a rank's window, no padding along the split dims: its forward
    (with the interior overlapped with the first exchange where `geom` is given) and its backward
    (aten.convolution_backward on the re-assembled window)."""

    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    transposed: bool = False
    output_padding: tuple[int, ...] = ()
    geom: Sliding | None = None  # a plain convolution's geometry: its interior can run before the halo
    windows: tuple[Window, ...] = ()

    def run(self, ext: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.transposed:
            return _CONV_T[weight.dim() - 2](ext, weight, bias, self.stride, self.padding, self.output_padding,
                                             self.groups, self.dilation)
        return _CONV[weight.dim() - 2](ext, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def early(self, x, weight, bias, halo: Halo, plans):
        if self.geom is None:
            return None
        return _interior_conv(x, weight, bias, self.geom, halo, self.windows, plans)

    def finish(self, ext, weight, bias, early, halo: Halo, plans) -> torch.Tensor:
        if early is None:
            return self.run(ext, weight, bias)
        assert self.geom is not None
        return _boundary_conv(ext, weight, bias, self.geom, halo, self.windows, plans, early)

    def backward(self, gy, ext, weight, bias_shape, needs: tuple[bool, bool, bool]):
        nd = weight.dim() - 2
        opad = self.output_padding or (0,) * nd
        return torch.ops.aten.convolution_backward(gy, ext, weight, bias_shape, list(self.stride), list(self.padding),
                                                   list(self.dilation), self.transposed, list(opad), self.groups,
                                                   list(needs))


@dataclass(frozen=True)
class _PoolOp:
    """Max or average pooling on a rank's window (no padding along the split dims); its backward
    recomputes the pooling on the re-assembled window (cheap next to a convolution), so neither the
    window nor max pooling's indices are kept."""

    kind: str
    geom: Sliding
    padding: tuple[int, ...]

    def run(self, ext: torch.Tensor, weight=None, bias=None) -> torch.Tensor:
        g, nd = self.geom, ext.dim() - 2
        if self.kind == "max":
            return _MAX[nd](ext, g.kernel, g.stride, self.padding, g.dilation)
        return _AVG[nd](ext, g.kernel, g.stride, self.padding, False, True)

    def early(self, *args):
        return None

    def finish(self, ext, weight, bias, early, halo, plans) -> torch.Tensor:
        return self.run(ext)

    def backward(self, gy, ext, weight, bias_shape, needs):
        with torch.enable_grad():
            e = ext.detach().requires_grad_(True)
            (gx,) = torch.autograd.grad(self.run(e), e, gy)
        return gx, None, None


def _local_only(plan: HaloPlan) -> bool:
    """No rank sends any row to another along this plan (e.g. a 2x2 stride-2 pool on even pieces)."""
    return all(b <= a for q in range(plan.parts) for r, (a, b) in enumerate(plan.sends[q]) if r != q)


class _HaloOp(torch.autograd.Function):
    """`op` on this rank's window of `x` (its piece, the halo rows the others send, the edge padding),
    keeping for backward only `x` (which its producer keeps anyway: the same storage) and the halo rows
    received, not the window: backward re-assembles the window from them (no exchange; the bytes are
    forward's and the halo reduction's, as before), runs the op's backward on it and sums the window's
    gradient back into the owners' pieces (the halo reduction). Keeping the window cost a second copy
    of every convolution's input on top of the piece: a rank under height=2 held about as much as one
    whole process."""

    @staticmethod
    def forward(ctx, x, weight, bias, op, halo: Halo, plans: tuple[HaloPlan, ...], pad_value: float):
        first = halo.splits[0]
        pending = _post_window(x, first.dim, plans[0], first.group, halo.tag)  # the halo goes out now ...
        early = op.early(x, weight, bias, halo, plans)  # ... while the interior (if any) computes
        ext, gots, shapes = x, [], []
        for i, (s, p) in enumerate(zip(halo.splits, plans)):
            got = _finish(pending if i == 0 else _post_window(ext, s.dim, p, s.group, halo.tag), halo.log, False)
            gots.append([None if g is None or q == s.group.index else g for q, g in enumerate(got)])
            shapes.append(tuple(ext.shape))
            ext = _assemble(ext, s.dim, p, s.group.index, got, pad_value)
        y = op.finish(ext, weight, bias, early, halo, plans)
        received = [g for row in gots for g in row if g is not None]
        ctx.save_for_backward(x, weight, *received)
        ctx.meta = (op, halo, plans, pad_value, [[g is not None for g in row] for row in gots], shapes,
                    None if bias is None else tuple(bias.shape))
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        op, halo, plans, pad_value, present, shapes, bias_shape = ctx.meta
        x, weight, *received = ctx.saved_tensors
        it = iter(received)
        ext = x
        for s, p, row in zip(halo.splits, plans, present):
            got = [next(it) if has else None for has in row]
            ext = _assemble(ext, s.dim, p, s.group.index, got, pad_value)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        gx, gw, gb = op.backward(gy.contiguous(), ext, weight, bias_shape, needs)
        del ext
        if needs[0]:
            for s, p, shape in reversed(list(zip(halo.splits, plans, shapes))):
                gx = _reduce(gx, s.dim, p, s.group, shape, halo.log, halo.tag)
        return (gx if needs[0] else None), gw, gb, None, None, None, None


def halo_apply(x: torch.Tensor, halo: Halo, windows: Sequence[Window], op, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, pad_value: float = 0.0) -> torch.Tensor | None:
    """`op` on this rank's window of `x` through `_HaloOp` (only the piece and the halo rows kept for
    backward). None where it does not apply: the dry run (meta tensors: shapes only, through
    halo_window), no split, or an output piece empty along a split dim (the caller's empty piece)."""
    if x.is_meta or not halo.splits:
        return None
    plans = tuple(halo_plan(w, s.group.size) for s, w in zip(halo.splits, windows))
    if any(b <= a for a, b in (p.out_piece(s.group.index) for s, p in zip(halo.splits, plans))):
        return None
    if any(b <= a for a, b in (p.window[s.group.index] for s, p in zip(halo.splits, plans))):
        return None  # no input reaches this rank's output rows (a transposed conv's edge): the caller's zeros
    return _HaloOp.apply(x, weight, bias, op, halo, plans, pad_value)


def _interior(w: Window, plan: HaloPlan, me: int) -> tuple[int, int]:
    """The output rows of this rank's piece whose input rows are all its own (or the op's zero padding
    at the tensor's edges): computable before any halo row arrives. May be empty (stop <= start)."""
    o0, o1 = plan.out_piece(me)
    i0, i1 = plan.in_piece(me)
    lo = -w.padding if i0 == 0 else i0  # padding rows are local only at the tensor's edges
    hi = w.size + w.padding if i1 == w.size else i1
    reach = w.dilation * (w.kernel - 1)
    return max(o0, -(-(lo + w.padding) // w.stride)), min(o1, (hi - 1 - reach + w.padding) // w.stride + 1)


def _interior_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, geom: Sliding, halo: Halo,
                   windows: Sequence[Window], plans: Sequence[HaloPlan]):
    """The interior of this rank's output piece (`_interior` along every split dim), computed from its
    own rows while the first exchange is in flight: (interior rows per split dim, its output), or None
    when the interior is empty along some split dim (all computed from the window then)."""
    inner = {s.dim: _interior(w, p, s.group.index) for s, w, p in zip(halo.splits, windows, plans)}
    if any(b <= a for a, b in inner.values()):
        return None
    xin = x
    for s, w, p in zip(halo.splits, windows, plans):
        i0, i1 = p.in_piece(s.group.index)
        a, b = w.needed(*inner[s.dim])
        xin = _zero_pad(xin.narrow(s.dim, max(a, i0) - i0, min(b, i1) - max(a, i0)), s.dim, max(0, i0 - a),
                        max(0, b - i1))
    return inner, _CONV[weight.dim() - 2](xin, weight, bias, geom.stride, geom.local_padding(halo), geom.dilation,
                                          geom.groups)


def _boundary_conv(ext: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, geom: Sliding, halo: Halo,
                   windows: Sequence[Window], plans: Sequence[HaloPlan], early) -> torch.Tensor:
    """The output piece from its interior (`early`) and the boundary slabs around it, computed from the
    window `ext` and concatenated: every output row once, from the same input rows and weights as the
    whole op."""
    inner, y_in = early
    outer = {s.dim: p.out_piece(s.group.index) for s, p in zip(halo.splits, plans)}
    if inner == outer:
        return y_in
    conv, pad = _CONV[weight.dim() - 2], geom.local_padding(halo)
    base = {s.dim: p.window[s.group.index][0] for s, p in zip(halo.splits, plans)}
    dims = [s.dim for s in halo.splits]
    win = dict(zip(dims, windows))

    def box(rows: dict[int, tuple[int, int]]) -> torch.Tensor:
        t = ext
        for d in dims:
            a, b = win[d].needed(*rows[d])
            t = t.narrow(d, a - base[d], b - a)
        return conv(t, weight, bias, geom.stride, pad, geom.dilation, geom.groups)

    # innermost dim first: the interior with its slabs along the last split dim, then that block with
    # its slabs along the one before, ... (a loop, not a recursive closure: that would be a reference
    # cycle keeping the window alive until the garbage collector runs)
    y = y_in
    for i in reversed(range(len(dims))):
        d = dims[i]
        (o0, o1), (u0, u1) = outer[d], inner[d]
        rows = {**{e: inner[e] for e in dims[:i]}, **{e: outer[e] for e in dims[i + 1:]}}
        parts = [box({**rows, d: (o0, u0)})] if u0 > o0 else []
        parts.append(y)
        if o1 > u1:
            parts.append(box({**rows, d: (u1, o1)}))
        y = torch.cat(parts, d) if len(parts) > 1 else parts[0]
    return y


def _zero_pad(t: torch.Tensor, dim: int, before: int, after: int, value: float = 0.0) -> torch.Tensor:
    """`t` with rows of `value` (zeros) before and after along `dim` (the op's padding at the tensor's edges)."""
    if not before and not after:
        return t
    pad = [0, 0] * (t.dim() - dim)  # F.pad's list: last dim first
    k = 2 * (t.dim() - 1 - dim)
    pad[k], pad[k + 1] = before, after
    return F.pad(t, pad, value=value)


def spatial_pool(x: torch.Tensor, kind: str, geom: Sliding, halo: Halo) -> torch.Tensor:
    """max or avg pooling (count_include_pad=True, no ceil_mode) of a spatially split input, as
    spatial_conv; max pads the tensor's edges with -inf, as torch's own padding behaves."""
    nd = x.dim() - 2
    if kind == "avg" and any(d != 1 for d in geom.dilation):
        raise ValueError("avg pooling has no dilation")
    pad_value = float("-inf") if kind == "max" else 0.0
    y = halo_apply(x, halo, geom.windows(halo), _PoolOp(kind, geom, geom.local_padding(halo)), pad_value=pad_value)
    if y is not None:
        return y
    ext = halo_window(x, halo.splits, geom.windows(halo), pad_value=pad_value, log=halo.log, tag=halo.tag)
    empty = geom.empty_out_shape(ext, x.shape[1], halo)
    if empty is not None:
        return _empty_piece(ext, empty)
    if kind == "max":
        return _MAX[nd](ext, geom.kernel, geom.stride, geom.local_padding(halo), geom.dilation)
    return _AVG[nd](ext, geom.kernel, geom.stride, geom.local_padding(halo), False, True)


def _empty_piece(ext: torch.Tensor, shape: tuple[int, ...], *params: torch.Tensor | None) -> torch.Tensor:
    """A rank whose output piece is empty (more ranks than output rows): an empty output that still
    depends on the exchange and the parameters, so this rank's backward runs the halo reduction its
    peers wait for and its parameters get (zero) gradients like everyone's."""
    tie = ext.sum() * 0
    for p in params:
        if p is not None:
            tie = tie + p.sum() * 0
    return ext.new_zeros(shape) + tie
