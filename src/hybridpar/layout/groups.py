"""Rank-group arithmetic of a layout's mesh (sample x channel x filter, row-major): which ranks form
each communication group. Shared by the planner's cost, the analytic collective model and the
runtime's process groups (vectorised with numpy: the planner asks for many layouts)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from hybridpar.layout.layer import LayerLayout

Groups = tuple[tuple[int, ...], ...]


def rank_of(i_s: int, i_c: int, i_f: int, layout: LayerLayout) -> int:
    return (i_s * layout.channel + i_c) * layout.filter + i_f


def _as_groups(ranks: np.ndarray) -> Groups:
    return tuple(map(tuple, ranks.tolist()))


@lru_cache(maxsize=1024)
def filter_groups(layout: LayerLayout) -> Groups:
    """f consecutive ranks: same sample group, same grid row (stationary-y/-w gather the input here)."""
    n, f = layout.size, layout.filter
    return _as_groups(np.arange(n).reshape(n // f, f))


@lru_cache(maxsize=1024)
def channel_groups(layout: LayerLayout) -> Groups:
    """c ranks f apart: same sample group, same grid column (stationary-x/-w reduce-scatter here)."""
    s, c, f = layout.size // (layout.channel * layout.filter), layout.channel, layout.filter
    # rank = (i_s c + i_c) f + i_f; a group fixes (i_s, i_f) and runs over i_c
    return _as_groups(np.arange(layout.size).reshape(s, c, f).transpose(0, 2, 1).reshape(s * f, c))


@lru_cache(maxsize=1024)
def sample_groups(layout: LayerLayout) -> Groups:
    """The G = c*f consecutive ranks sharing one block of samples."""
    g = layout.g_size
    return _as_groups(np.arange(layout.size).reshape(layout.size // g, g))


@lru_cache(maxsize=1024)
def shard_groups(layout: LayerLayout) -> Groups:
    """Ranks holding the same weight shard (and the same channel slice): the segmented allreduce."""
    g = layout.g_size
    return _as_groups(np.arange(layout.size).reshape(layout.size // g, g).T)


def group_of(rank: int, groups: Groups) -> tuple[int, ...]:
    """The group of `groups` that holds `rank`."""
    return next(g for g in groups if rank in g)
