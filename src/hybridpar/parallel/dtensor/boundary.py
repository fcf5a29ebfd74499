"""Global semantics: the DeviceMesh of a layout, and the boundary between DTensors (what user code
between layers sees: whole tensors, global shapes) and local pieces (what our distributed layer
algorithms compute on).

The mesh is named (sample, channel, filter) as in hybridpar.layout; activations live on its
(sample, channel_filter) view, channel and filter flattened, because every layout with the same
G = P_C*P_F chains without a move (their boundary pieces are the same G channel pieces).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from math import prod

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils._pytree import tree_map_only

from hybridpar.layout import LayerLayout, piece_offsets, piece_sizes

ACT_DIMS = ("sample", "channel_filter")


@dataclass
class Meshes:
    """The world's mesh for one layout and its activation view."""

    full: object  # DeviceMesh (sample, channel, filter)
    act: object  # DeviceMesh (sample, channel_filter)

    @property
    def sample(self) -> int:
        return self.act.size(0)

    @property
    def g_size(self) -> int:
        return self.act.size(1)


_MESHES: dict[tuple, Meshes] = {}


def build_meshes(layout: LayerLayout, device_type: str) -> Meshes:
    """Collective: every rank calls it (DeviceMesh creates process groups). One per layout and world:
    later models on the same layout reuse it (process groups are costly to create)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    key = (layout.sample, layout.channel, layout.filter, device_type, id(dist.group.WORLD))
    if key in _MESHES:
        return _MESHES[key]

    full = init_device_mesh(device_type, (layout.sample, layout.channel, layout.filter),
                            mesh_dim_names=("sample", "channel", "filter"))
    full["channel", "filter"]._flatten("channel_filter")  # DeviceMesh's own way to name a joint dim
    with warnings.catch_warnings():  # "slicing a flattened dim ... will be deprecated": still the way in 2.13
        warnings.simplefilter("ignore", UserWarning)
        _MESHES[key] = Meshes(full, full[ACT_DIMS])
    return _MESHES[key]


def boundary_placements(meshes: Meshes, dim: int = 1) -> list:
    """An activation between layers: samples over `sample`, channels (`dim`) over channel_filter."""
    return [Shard(0), Shard(dim) if meshes.g_size > 1 else Replicate()]


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
        import copy

        ctx.spec = copy.copy(x._spec)
        ctx.set_materialize_grads(False)
        local = x._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, g):
        import copy

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
        import copy

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
    def one(t: torch.Tensor):
        if t.dim() == 0:
            return DTensor.from_local(t, meshes.act, [Replicate(), Replicate()], run_check=False)
        if sample_shard:
            shape = (t.shape[0] * meshes.sample, *t.shape[1:])
            local = t
        else:
            shape, local = tuple(t.shape), t[local_rows(t.shape[0], meshes)]
        return from_local(local, meshes, [Shard(0), Replicate()], shape)
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
    def forward(ctx, local, grid, cdim: int, channels: int, n: int, samples: bool = True):
        from hybridpar.parallel.comm.collectives import all_gather_dim

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
        from hybridpar.parallel.dtensor.rules import replicate_plain_tensors

        replicate_plain_tensors()  # the backward's thread (a device thread on CUDA) mixes them too
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
        p0, p1 = t.placements
        if sample_shard and t.dim() > 0 and p0 == Shard(0):
            if isinstance(p1, Shard) or p1 == Replicate():
                cdim = p1.dim if isinstance(p1, Shard) else -1
                local = t.to_local(grad_placements=t.placements)
                return _GatherWhole.apply(local, grid, cdim, t.shape[cdim] if cdim >= 0 else 0, t.shape[0], False)
            return t.redistribute(meshes.act, [Shard(0), Replicate()]).to_local()
        if t.dim() > 0 and p0 in (Shard(0), Replicate()) and (isinstance(p1, Shard) or p1 == Replicate()) \
                and (p0 == Shard(0) or grid.sample == 1):
            cdim = p1.dim if isinstance(p1, Shard) else -1
            local = t.to_local(grad_placements=t.placements)
            return _GatherWhole.apply(local, grid, cdim, t.shape[cdim] if cdim >= 0 else 0, t.shape[0])
        return t.full_tensor()
    if isinstance(out, DTensor):  # the common case, without pytree
        return one(out)
    return tree_map_only(DTensor, one, out)


def replicate_param(p: torch.Tensor, meshes: Meshes) -> DTensor:
    return DTensor.from_local(p.detach(), meshes.act, [Replicate(), Replicate()], run_check=False)


def nbytes(t: torch.Tensor) -> int:
    return prod(t.shape) * t.element_size()


__all__ = ["ACT_DIMS", "Meshes", "Partial", "Replicate", "Shard", "boundary_placements", "build_meshes",
           "channel_piece", "distribute_input", "from_local", "gather_output", "global_shape_of",
           "local_rows", "replicate_param", "to_local"]
