"""The plan's mesh and every process group derived from it.

One description, `MeshDims`: named dimensions, outermost first, ranks row-major over them (the
layout vocabulary's convention, hybridpar.layout). A group is the set of ranks that differ only along
some of the dims (`MeshDims.groups(*over)`); every group the runtime creates is one of those:

- a layout's mesh (sample, channel, filter) (`MeshDims.of_layout`): the DeviceMesh activations live on
  (`build_meshes`, with channel x filter flattened to channel_filter) and the `ProcessGrid` of our
  distributed layers. Rank r is at sample group s = r // G, grid position g = r % G (G = P_C*P_F):
  - `sample_group` ("G-group"), over (channel, filter): the G ranks sharing this rank's samples (loss
    gather, shape handshake);
  - `replica_group`, over (sample,): the S ranks at the same position g across sample groups: they hold
    the same weight shard and the same channel piece, so the segmented allreduce of weight gradients
    and batch-norm statistics run in it;
  - per (P_C, P_F) factorisation of G: the filter group, over (filter,) (same row i, P_F ranks;
    stationary-y/w gather x) and the channel group, over (channel,) (same column j, P_C ranks;
    stationary-x/w reduce-scatter y).
  With spatial splits (depth/height/width, between sample and channel in rank order) the grid's
  `spatial` ranks split each sample group's samples' spatial dims: s = r // (spatial * G); the
  `replica_group` stays over (sample,) (the loss, the outputs' samples) and `stats_group`, over
  (sample, spatial), is where weight gradients and batch-norm statistics are summed. The DeviceMesh
  has a dim per split spatial dim; the halo exchanges run in its groups.
- hybrid DP x MP (`MeshDims.hybrid`): (sample, stage): D replicas of an M-stage placement; a stage's
  data-parallel group runs over (sample,), a replica's stages over (stage,) (pipeline.layout).

Left to do: the ProcessGrid's groups and the DeviceMesh's are created separately (the same rank sets
twice, for the layouts that use both); one DeviceMesh holding every group is the next step.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from math import prod

import numpy as np
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor.placement_types import Placement as DPlacement

from hybridpar.errors import UserError
from hybridpar.layout import MESH_DIMS, GridPos, LayerLayout, Partial, Placement, Shard
from hybridpar.layout.placements import act_mesh_dims, spatial_mesh_dims
from hybridpar.parallel.comm.log import CommLog

ACT_DIMS = ("sample", "channel_filter")
STAGE_DIM = "stage"


@dataclass(frozen=True)
class MeshDims:
    """Named mesh dimensions, outermost first; rank = row-major index over them."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @classmethod
    def of_layout(cls, layout: LayerLayout) -> MeshDims:
        """(sample, [depth, height, width: those split], channel, filter): hybridpar.layout.ORDER."""
        spatial = spatial_mesh_dims(layout)
        return cls((MESH_DIMS[0], *spatial, *MESH_DIMS[1:]),
                   (layout.sample, *(getattr(layout, d) for d in spatial), layout.channel, layout.filter))

    @classmethod
    def hybrid(cls, dp: int, mp: int) -> MeshDims:
        """D replicas (the sample dim) of an M-stage model-parallel placement."""
        return cls(("sample", STAGE_DIM), (dp, mp))

    @property
    def size(self) -> int:
        return prod(self.sizes)

    def groups(self, *over: str) -> list[tuple[int, ...]]:
        """Every rank set that varies along the dims `over` only (members in row-major order over
        `over`), one per setting of the other dims, in row-major order of those."""
        axes = [self.names.index(n) for n in over]
        rest = [i for i in range(len(self.names)) if i not in axes]
        ranks = np.arange(self.size).reshape(self.sizes).transpose(rest + axes)
        return [tuple(g) for g in ranks.reshape(-1, prod(self.sizes[i] for i in axes)).tolist()]

    def group_of(self, rank: int, *over: str) -> tuple[int, ...]:
        return next(g for g in self.groups(*over) if rank in g)


def to_dtensor_placements(named: dict[str, Placement], mesh_dim_names: Sequence[str]) -> list[DPlacement]:
    """The layout vocabulary's placements (hybridpar.layout.placements) as DTensor's, one per dim of
    a DeviceMesh with these dim names, one to one."""
    def one(pl: Placement) -> DPlacement:
        if isinstance(pl, Shard):
            return DShard(pl.dim)
        return DPartial() if isinstance(pl, Partial) else DReplicate()
    return [one(named[name]) for name in mesh_dim_names]


@dataclass(frozen=True)
class Group:
    """An ordered rank set; `pg` is None for a 1-rank group (no communication needed)."""

    ranks: tuple[int, ...]
    pg: dist.ProcessGroup | None
    index: int  # this rank's index in `ranks`

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class ProcessGrid:
    sample: int
    g_size: int
    rank: int
    world_size: int
    comm_log: CommLog = field(default_factory=CommLog)
    _groups: dict[tuple[int, ...], Group] = field(default_factory=dict)
    _factorizations: tuple[tuple[int, int], ...] = ()
    spatial: int = 1  # ranks splitting one sample's depth x height x width (between sample and G)

    def _dims(self, channel: int = 0, filter_: int = 1) -> MeshDims:
        return _grid_dims(self.sample, self.spatial, channel or self.g_size, filter_)

    @property
    def s(self) -> int:
        return self.rank // (self.g_size * self.spatial)

    @property
    def sp(self) -> int:
        """This rank's index among the spatial ranks of its sample group (row-major over depth,
        height, width)."""
        return (self.rank // self.g_size) % self.spatial

    @property
    def g(self) -> int:
        return self.rank % self.g_size

    def pos(self, channel: int, filter_: int) -> GridPos:
        if channel * filter_ != self.g_size:
            raise UserError(f"layout channel={channel},filter={filter_} does not use the {self.g_size} "
                            "ranks of a sample group")
        return GridPos(channel, filter_, self.g)

    def group(self, ranks: tuple[int, ...]) -> Group:
        if len(ranks) == 1:
            return Group(ranks, None, 0)
        try:
            return self._groups[ranks]
        except KeyError:
            raise RuntimeError(f"process group {ranks} was not created by build_grid") from None

    # cached: asked per parameter per step (GradSync), and the rank sets are fixed once built
    @cached_property
    def sample_group(self) -> Group:
        return self.group(self._dims().group_of(self.rank, "channel", "filter"))

    @cached_property
    def replica_group(self) -> Group:
        """The ranks holding the same channel piece of the same spatial piece of other samples."""
        return self.group(self._dims().group_of(self.rank, "sample"))

    @cached_property
    def stats_group(self) -> Group:
        """The ranks holding the same channel piece of any samples' any spatial piece: a weight shard's
        gradient and a batch norm's statistics are sums over it (the replica group without spatial
        splits)."""
        if self.spatial == 1:
            return self.replica_group
        return self.group(self._dims().group_of(self.rank, "sample", "spatial"))

    @cached_property
    def spatial_group(self) -> Group:
        """The ranks holding the spatial pieces of this rank's samples and channel piece."""
        return self.group(self._dims().group_of(self.rank, "spatial"))

    def filter_group(self, channel: int, filter_: int) -> Group:
        self.pos(channel, filter_)  # checks channel * filter == G
        return self.group(self._dims(channel, filter_).group_of(self.rank, "filter"))

    def channel_group(self, channel: int, filter_: int) -> Group:
        self.pos(channel, filter_)
        return self.group(self._dims(channel, filter_).group_of(self.rank, "channel"))


def _grid_dims(sample: int, spatial: int, channel: int, filter_: int = 1) -> MeshDims:
    """The grid's dims, the spatial ones flattened into one (row-major order is kept)."""
    return MeshDims(("sample", "spatial", "channel", "filter"), (sample, spatial, channel, filter_))


def _rank_sets(sample: int, g_size: int, factorizations: Iterable[tuple[int, int]],
               spatial: int = 1) -> list[tuple[int, ...]]:
    """Every multi-rank group of the grid, in one deterministic order (all ranks must create every
    group in the same order, members or not)."""
    whole = _grid_dims(sample, spatial, g_size)
    sets = whole.groups("channel", "filter")
    for c, f in factorizations:
        dims = _grid_dims(sample, spatial, c, f)
        sets += [*dims.groups("filter"), *dims.groups("channel")]
    sets += whole.groups("sample")
    if spatial > 1:
        sets += [*whole.groups("spatial"), *whole.groups("sample", "spatial")]
    return list(dict.fromkeys(r for r in sets if len(r) > 1))


def new_groups(rank_sets: Iterable[tuple[int, ...]]) -> dict[tuple[int, ...], Group]:
    """Create a process group per rank set (collective: every rank of the world, same order) and
    return the Groups this rank belongs to."""
    rank = dist.get_rank()
    mine: dict[tuple[int, ...], Group] = {}
    for ranks in rank_sets:
        pg = dist.new_group(list(ranks)) if len(ranks) > 1 else None
        if rank in ranks:
            mine[ranks] = Group(ranks, pg, ranks.index(rank))
    return mine


def build_grid(sample: int, g_size: int, factorizations: Iterable[tuple[int, int]] = (),
               comm_log: CommLog | None = None, spatial: int = 1) -> ProcessGrid:
    """Create the grid's process groups. Collective: every rank of the world must call it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if sample * spatial * g_size != world:
        what = f"sample={sample} x {g_size}" if spatial == 1 else f"sample={sample} x spatial {spatial} x {g_size}"
        raise UserError(f"layout uses {what} = {sample * spatial * g_size} ranks, but the world has {world}")
    facts = tuple(sorted(set(factorizations) | {(g_size, 1), (1, g_size)}))
    groups = new_groups(_rank_sets(sample, g_size, facts, spatial))
    return ProcessGrid(sample, g_size, rank, world, comm_log or CommLog(), groups, facts, spatial)


@dataclass
class Meshes:
    """The world's DeviceMesh for one layout (sample, channel, filter) and its activation view
    (sample, channel_filter)."""

    full: DeviceMesh
    act: DeviceMesh
    spatial: tuple[str, ...] = ()  # the split spatial dims (depth, height, width), between sample and channel_filter

    @property
    def sample(self) -> int:
        return self.act.size(0)

    @property
    def g_size(self) -> int:
        return self.act.size(self.act.ndim - 1)


_MESHES: dict[tuple, Meshes] = {}


def build_meshes(layout: LayerLayout, device_type: str) -> Meshes:
    """Collective: every rank calls it (DeviceMesh creates process groups). One per layout and world:
    later models on the same layout reuse it (process groups are costly to create)."""
    key = (layout.sample, layout.depth, layout.height, layout.width, layout.channel, layout.filter, device_type,
           id(dist.group.WORLD))
    if key in _MESHES:
        return _MESHES[key]
    dims = MeshDims.of_layout(layout)
    full = init_device_mesh(device_type, dims.sizes, mesh_dim_names=dims.names)
    full["channel", "filter"]._flatten(ACT_DIMS[1])  # DeviceMesh's own way to name a joint dim
    with warnings.catch_warnings():  # "slicing a flattened dim ... will be deprecated": still the way in 2.13
        warnings.simplefilter("ignore", UserWarning)
        _MESHES[key] = Meshes(full, full[act_mesh_dims(layout)], spatial_mesh_dims(layout))
    if layout.spatial > 1:  # 3-4 mesh dims: DTensor's strategy expansion is k^dims (see propagation)
        from hybridpar.parallel.dtensor.propagation import register

        register(_MESHES[key].act)
    return _MESHES[key]


def forget_meshes() -> None:
    """Drop the cached meshes (their process groups belong to a world that is gone)."""
    _MESHES.clear()
