"""Placements over named mesh dimensions, in DTensor's words, without torch.

The runtime turns them into torch.distributed.tensor placements one to one
(hybridpar.parallel.mesh.to_dtensor_placements): the activations between parallel layers are
laid out by `activation_placements`."""

from __future__ import annotations

from dataclasses import dataclass

from hybridpar.layout.layer import LayerLayout

# Named mesh dimensions, outermost first (rank order is row-major over them).
MESH_DIMS = ("sample", "channel", "filter")


@dataclass(frozen=True)
class Shard:
    dim: int


@dataclass(frozen=True)
class Replicate:
    pass


@dataclass(frozen=True)
class Partial:
    """Each rank holds a summand of the tensor (a weight gradient before its allreduce)."""


Placement = Shard | Replicate | Partial


# One sample's spatial dimensions, outermost first (hybridpar.layout.halo's convention).
SPATIAL_DIMS = ("depth", "height", "width")


def spatial_tensor_dim(name: str, ndim: int) -> int | None:
    """The dim of an [N, C, *spatial] tensor of `ndim` dims that mesh dimension `name` splits: the
    spatial dims are the last ndim-2 of (depth, height, width), so a 2-D layer's height is dim 2 and
    width dim 3, a 3-D layer's depth dim 2, a 1-D layer's length is `width`. None: the tensor has no
    such dimension (a height split of an [N, C, L] or [N, F] tensor)."""
    k = ndim - 2
    if not 1 <= k <= len(SPATIAL_DIMS):
        return None
    i = SPATIAL_DIMS.index(name) - (len(SPATIAL_DIMS) - k)
    return 2 + i if i >= 0 else None


def spatial_mesh_dims(layout: LayerLayout) -> tuple[str, ...]:
    """The spatial mesh dimensions a layout splits (degree > 1), outermost first."""
    return tuple(d for d in SPATIAL_DIMS if getattr(layout, d) > 1)


def act_mesh_dims(layout: LayerLayout) -> tuple[str, ...]:
    """The activations' mesh dimensions: sample, the split spatial ones, channel x filter flattened."""
    return ("sample", *spatial_mesh_dims(layout), "channel_filter")


def activation_placements(layout: LayerLayout, channel_dim: int = 1, ndim: int | None = None) -> dict[str, Placement]:
    """An [N, C, ...] activation at a layer boundary: samples split over `sample`, channels (dim
    `channel_dim`: the features' last dim for a Linear's) over the flattened channel x filter
    dimension (every layout with the same G chains without a move), and, for a layout with spatial
    splits, an `ndim`-dim activation's spatial dims over their mesh dims (`spatial_tensor_dim`;
    whole where the tensor has no such dim)."""
    out: dict[str, Placement] = {"sample": Shard(0)}
    for name in spatial_mesh_dims(layout):
        d = spatial_tensor_dim(name, ndim) if ndim is not None else None
        out[name] = Shard(d) if d is not None else Replicate()
    out["channel_filter"] = Shard(channel_dim) if layout.g_size > 1 else Replicate()
    return out
