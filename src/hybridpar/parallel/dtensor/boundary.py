"""Global semantics: the boundary between DTensors (what user code between layers sees: whole
tensors, global shapes) and local pieces (what our distributed layer algorithms compute on).

The mesh (hybridpar.parallel.mesh.build_meshes) is named (sample, channel, filter) as in
hybridpar.layout; activations live on its (sample, channel_filter) view, channel and filter
flattened, because every layout with the same G = P_C*P_F chains without a move (their boundary
pieces are the same G channel pieces), laid out by the layout vocabulary's `activation_placements`.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from math import prod

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.utils._pytree import tree_map_only

from hybridpar.layout import LayerLayout, activation_placements, piece_offsets, piece_sizes
from hybridpar.parallel.comm.collectives import all_gather_dim
from hybridpar.parallel.mesh import ACT_DIMS, Meshes, ProcessGrid, build_meshes, to_dtensor_placements


@lru_cache(maxsize=256)
def _boundary(sample: int, g_size: int, dim: int, spatial: tuple[tuple[str, int], ...] = (),
              ndim: int | None = None) -> tuple[Placement, ...]:
    named = activation_placements(LayerLayout(sample=sample, channel=g_size, **dict(spatial)), dim, ndim)
    return tuple(to_dtensor_placements(named, ("sample", *(n for n, _ in spatial), "channel_filter")))


def boundary_placements(meshes: Meshes, dim: int = 1, ndim: int | None = None) -> list[Placement]:
    """An activation between layers: samples over `sample`, channels (`dim`) over channel_filter, and
    with spatial splits an `ndim`-dim activation's spatial dims over theirs (hybridpar.layout.placements)."""
    if not meshes.spatial:
        return list(_boundary(meshes.sample, meshes.g_size, dim))
    sizes = tuple((n, meshes.act.size(1 + i)) for i, n in enumerate(meshes.spatial))
    return list(_boundary(meshes.sample, meshes.g_size, dim, sizes, ndim))


def contiguous_stride(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def runtime_code():
    """Around a parallel layer's own work inside the model's forward: torch-function modes (the
    model's ChannelCatMode, which exists for the user's code between layers) skip the ~40 torch calls
    the layer makes on its local pieces and buffers. py-spy put the mode's own frames at ~10% of a
    channel/filter step's samples. The layer's torch.cat calls are copies into buffers anyway."""
    return torch._C.DisableTorchFunction()


def to_local(x, meshes: Meshes, placements: list) -> torch.Tensor:
    """This rank's piece of `x` under `placements` (redistributing first when x is laid out otherwise).
    The gradient of the piece is the piece of the gradient: same placements."""
    if not isinstance(x, DTensor):
        raise TypeError(f"expected a DTensor at a parallel layer's input, got {type(x).__name__}")
    if tuple(x.placements) != tuple(placements):
        x = x.redistribute(meshes.act, placements)
    if x.requires_grad and tuple(x._spec.tensor_meta.stride) == contiguous_stride(x.shape):
        return _ToLocal.apply(x)
    return x.to_local(grad_placements=placements)


class _ToLocal(torch.autograd.Function):
    """DTensor.to_local whose backward wraps the (contiguous) local gradient with a copy of the
    input's spec: DTensor's own builds and verifies a new spec per call through from_local."""

    @staticmethod
    def forward(ctx, x: DTensor) -> torch.Tensor:
        ctx.spec = copy.copy(x._spec)
        ctx.set_materialize_grads(False)
        local = x._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return None
        spec = ctx.spec
        if not g.is_contiguous():
            g = g.contiguous()  # the spec says contiguous; so must the piece be
        return DTensor(g, copy.copy(spec), requires_grad=False)


def from_local(t: torch.Tensor, meshes: Meshes, placements: list, global_shape) -> DTensor:
    """Wrap this rank's piece `t` as the DTensor of `global_shape` (pieces may be uneven), settled.

    Every parallel layer wraps its output each step with the same mesh, placements and shape, so the
    DTensorSpec is built once and copied (DTensor.from_local builds and verifies a new one per call:
    ~1/5 of a channel/filter step's CPU time on small models, sampled with py-spy). `_FromLocal` is
    DTensor's own from_local autograd function (torch 2.13 `_FromTorchTensor`) given that spec."""
    key = (id(meshes.act), tuple(placements), tuple(global_shape), t.dtype)
    hit = _SPECS.get(key)
    if hit is None or hit[0] is not meshes.act:
        shape = torch.Size(tuple(global_shape))
        plain = DTensor.from_local(t, meshes.act, placements, run_check=False, shape=shape,
                                   stride=contiguous_stride(shape))
        if _settled(shape, plain.placements, meshes) != list(plain.placements):  # gathered: the general path
            return settle(plain, meshes)
        hit = _SPECS[key] = (meshes.act, plain._spec)
        if len(_SPECS) > 4096:  # shapes vary (last partial batch, sequence lengths): keep it bounded
            _SPECS.clear()
        return plain
    return _FromLocal.apply(t, hit[1])


_SPECS: dict[tuple, tuple] = {}  # (mesh id, placements, global shape, dtype) -> (mesh, DTensorSpec)


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, spec) -> DTensor:
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        # a fresh spec object per tensor, as DTensor's own code keeps them (sharding propagation may
        # cache on it); a shallow copy skips the constructor's checks, done once for this key
        return DTensor(t.view_as(t), copy.copy(spec), requires_grad=t.requires_grad)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None
        spec = ctx.spec
        if tuple(grad.placements) != tuple(spec.placements):
            grad = grad.redistribute(spec.mesh, spec.placements)
        return grad.to_local(), None


def settle(t: DTensor, meshes: Meshes) -> DTensor:
    """A parallel layer's output as user code may see it: where a channel piece would be empty on
    some rank (fewer channels than ranks, or torch.chunk's short tail), gather channels instead,
    since ops such as pooling reject 0-channel inputs and one rank's error would hang the others."""
    places = _settled(t.shape, t.placements, meshes)
    return t if places == list(t.placements) else t.redistribute(meshes.act, places)


def _settled(shape, placements, meshes: Meshes) -> list:
    places = list(placements)
    for d, pl in enumerate(places):
        if isinstance(pl, Shard) and piece_sizes(shape[pl.dim], meshes.act.size(d))[-1] == 0:
            places[d] = Replicate()
    return places


def global_shape_of(local: torch.Tensor, meshes: Meshes, channel_dim: int, channels: int) -> tuple[int, ...]:
    shape = list(local.shape)
    shape[0] *= meshes.sample
    shape[channel_dim] = channels
    return tuple(shape)


def local_rows(n: int, meshes: Meshes) -> slice:
    """This rank's samples of a global batch of n (the sample degree divides n, checked up front)."""
    s = meshes.act.get_local_rank("sample")
    per = n // meshes.sample
    return slice(s * per, (s + 1) * per)


def channel_piece(n: int, meshes: Meshes) -> tuple[int, int]:
    g = meshes.act.get_local_rank("channel_filter")
    return piece_offsets(n, meshes.g_size)[g], piece_sizes(n, meshes.g_size)[g]


def distribute_input(x, meshes: Meshes, *, sample_shard: bool):
    """A user input (the global batch, same on every rank; or, with sample_shard, this rank's samples)
    as a DTensor split on samples and whole on channel_filter: no communication at all."""
    rest = [Replicate()] * (meshes.act.ndim - 1)  # spatial dims too: our spatial layers take their pieces

    def one(t: torch.Tensor):
        if t.dim() == 0:
            return DTensor.from_local(t, meshes.act, [Replicate(), *rest], run_check=False)
        if sample_shard:
            shape = (t.shape[0] * meshes.sample, *t.shape[1:])
            local = t
        else:
            shape, local = tuple(t.shape), t[local_rows(t.shape[0], meshes)]
        return from_local(local, meshes, [Shard(0), *rest], shape)
    if isinstance(x, tuple) and all(type(t) is torch.Tensor for t in x):  # the common case, without pytree
        return tuple(one(t) for t in x)
    if isinstance(x, dict) and not x:
        return x
    return tree_map_only(torch.Tensor, lambda t: t if isinstance(t, DTensor) else one(t), x)


class _GatherWhole(torch.autograd.Function):
    """A boundary-laid-out output made whole on every rank with our logged collectives: channels in
    the sample group, then samples over the sample groups. Every rank then computes the same loss, so
    the backward is this rank's slice of the gradient, with no communication."""

    @staticmethod
    def forward(ctx, local, grid: ProcessGrid, cdim: int, channels: int, n: int, samples: bool = True):
        ctx.cdim, ctx.channels, ctx.n, ctx.grid, ctx.samples = cdim, channels, n, grid, samples
        t = local
        if cdim >= 0:
            t = all_gather_dim(t.contiguous(), cdim, grid.sample_group, piece_sizes(channels, grid.g_size),
                               grid.comm_log, "output:fwd")
        if grid.sample > 1 and samples:
            t = all_gather_dim(t.contiguous(), 0, grid.replica_group, piece_sizes(n, grid.sample),
                               grid.comm_log, "output:fwd")
        return t

    @staticmethod
    def backward(ctx, d):
        grid = ctx.grid
        if grid.sample > 1 and ctx.samples:
            d = d.narrow(0, piece_offsets(ctx.n, grid.sample)[grid.s], piece_sizes(ctx.n, grid.sample)[grid.s])
        if ctx.cdim >= 0:
            d = d.narrow(ctx.cdim, piece_offsets(ctx.channels, grid.g_size)[grid.g],
                         piece_sizes(ctx.channels, grid.g_size)[grid.g])
        return d.contiguous(), None, None, None, None, None


def gather_output(out, meshes: Meshes, grid, *, sample_shard: bool):
    """The model's outputs as ordinary tensors: whole (same on every rank), or this rank's samples."""
    def one(t: DTensor):
        if meshes.spatial:  # spatial pieces made whole first (DTensor's gather); samples and channels below
            t = _whole_spatially(t, meshes)
        p0, p1 = t.placements[0], t.placements[-1]
        if sample_shard and t.dim() > 0 and p0 == Shard(0):
            if isinstance(p1, Shard) or p1 == Replicate():
                cdim = p1.dim if isinstance(p1, Shard) else -1
                local = t.to_local(grad_placements=t.placements)
                return _GatherWhole.apply(local, grid, cdim, t.shape[cdim] if cdim >= 0 else 0, t.shape[0], False)
            return t.redistribute(meshes.act, [Shard(0), *[Replicate()] * (meshes.act.ndim - 1)]).to_local()
        if t.dim() > 0 and p0 in (Shard(0), Replicate()) and (isinstance(p1, Shard) or p1 == Replicate()) \
                and (p0 == Shard(0) or grid.sample == 1):
            cdim = p1.dim if isinstance(p1, Shard) else -1
            local = t.to_local(grad_placements=t.placements)
            return _GatherWhole.apply(local, grid, cdim, t.shape[cdim] if cdim >= 0 else 0, t.shape[0])
        return t.full_tensor()
    if isinstance(out, DTensor):  # the common case, without pytree
        return one(out)
    return tree_map_only(DTensor, one, out)


def _whole_spatially(t: DTensor, meshes: Meshes) -> DTensor:
    """`t` with every spatial mesh dim Replicate (a Partial one summed)."""
    places = list(t.placements)
    for i in range(1, 1 + len(meshes.spatial)):
        places[i] = Replicate()
    return t if places == list(t.placements) else t.redistribute(meshes.act, places)


def replicate_param(p: torch.Tensor, meshes: Meshes) -> DTensor:
    return DTensor.from_local(p.detach(), meshes.act, [Replicate()] * meshes.act.ndim, run_check=False)


def nbytes(t: torch.Tensor) -> int:
    return prod(t.shape) * t.element_size()


__all__ = ["ACT_DIMS", "Meshes", "Partial", "Replicate", "Shard", "boundary_placements", "build_meshes",
           "channel_piece", "distribute_input", "from_local", "gather_output", "global_shape_of",
           "local_rows", "replicate_param", "to_local"]
