"""The process grid: world = S sample groups x G ranks (G = P_C*P_F) and the subgroups each
algorithm needs. Rank r is at sample group s = r // G, grid position g = r % G.

Groups, for this rank:
- `sample_group` ("G-group"): the G ranks sharing this rank's samples (loss gather, shape handshake);
- `replica_group`: the S ranks at the same position g across sample groups: they hold the same weight
  shard and the same channel piece, so the segmented allreduce of weight gradients and batch-norm
  statistics run in it (S disjoint-by-position groups allreduce concurrently);
- per (P_C, P_F) factorisation of G: the filter group (same row i, P_F ranks; stationary-y/w gather x)
  and the channel group (same column j, P_C ranks; stationary-x/w reduce-scatter y).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch.distributed as dist

from hybridpar.errors import UserError
from hybridpar.layout import GridPos, LayerLayout
from hybridpar.layout.groups import channel_groups, filter_groups, group_of, sample_groups, shard_groups
from hybridpar.parallel.comm.log import CommLog


@dataclass(frozen=True)
class Group:
    """An ordered rank set; `pg` is None for a 1-rank group (no communication needed)."""

    ranks: tuple[int, ...]
    pg: object | None
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

    @property
    def s(self) -> int:
        return self.rank // self.g_size

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

    def _layout(self, channel: int = 0, filter_: int = 1) -> LayerLayout:
        return LayerLayout(sample=self.sample, channel=channel or self.g_size, filter=filter_)

    # cached: asked per parameter per step (GradSync), and the rank sets are fixed once built
    @cached_property
    def sample_group(self) -> Group:
        return self.group(group_of(self.rank, sample_groups(self._layout())))

    @cached_property
    def replica_group(self) -> Group:
        return self.group(group_of(self.rank, shard_groups(self._layout())))

    def filter_group(self, channel: int, filter_: int) -> Group:
        self.pos(channel, filter_)  # checks channel * filter == G
        return self.group(group_of(self.rank, filter_groups(self._layout(channel, filter_))))

    def channel_group(self, channel: int, filter_: int) -> Group:
        self.pos(channel, filter_)
        return self.group(group_of(self.rank, channel_groups(self._layout(channel, filter_))))


def _rank_sets(sample: int, g_size: int, factorizations) -> list[tuple[int, ...]]:
    """Every multi-rank group of the grid, in one deterministic order (all ranks must create every
    group in the same order, members or not)."""
    sets: list[tuple[int, ...]] = list(sample_groups(LayerLayout(sample=sample, channel=g_size)))
    for c, f in factorizations:
        lay = LayerLayout(sample=sample, channel=c, filter=f)
        sets += [*filter_groups(lay), *channel_groups(lay)]
    sets += shard_groups(LayerLayout(sample=sample, channel=g_size))
    seen: dict[tuple[int, ...], None] = {}
    for r in sets:
        if len(r) > 1:
            seen.setdefault(tuple(r), None)
    return list(seen)


def build_grid(sample: int, g_size: int, factorizations=(), comm_log: CommLog | None = None) -> ProcessGrid:
    """Create the grid's process groups. Collective: every rank of the world must call it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if sample * g_size != world:
        raise UserError(f"layout uses sample={sample} x {g_size} = {sample * g_size} ranks, "
                        f"but the world has {world}")
    facts = tuple(sorted(set(factorizations) | {(g_size, 1), (1, g_size)}))
    grid = ProcessGrid(sample, g_size, rank, world, comm_log or CommLog(), {}, facts)
    for ranks in _rank_sets(sample, g_size, facts):
        pg = dist.new_group(list(ranks))
        if rank in ranks:
            grid._groups[ranks] = Group(ranks, pg, ranks.index(rank))
    return grid
