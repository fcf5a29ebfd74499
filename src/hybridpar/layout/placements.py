"""Placements over named mesh dimensions, in DTensor's words, without torch.

The planner and the cost model reason with these; the runtime turns them into
torch.distributed.tensor placements one to one (hybridpar.parallel.mesh.to_dtensor_placements)."""

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


def activation_placements(layout: LayerLayout) -> dict[str, Placement]:
    """An [N, C, ...] activation at a layer boundary: samples split over `sample`, channels over the
    flattened channel x filter dimension (every layout with the same G chains without a move)."""
    return {"sample": Shard(0), "channel_filter": Shard(1) if layout.g_size > 1 else Replicate()}


def weight_placements(layout: LayerLayout) -> dict[str, Placement]:
    """A [F, C, ...] weight: filters over `filter`, input channels over `channel`, whole on `sample`.
    Under stationary-w the filter rows a rank holds are strided (pieces j, P_F+j, ...), so that the
    channel group's reduce-scatter hands each rank its own boundary piece (GridPos.out_piece_ids)."""
    return {"sample": Replicate(),
            "channel": Shard(1) if layout.channel > 1 else Replicate(),
            "filter": Shard(0) if layout.filter > 1 else Replicate()}
