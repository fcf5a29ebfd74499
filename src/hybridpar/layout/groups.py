"""Rank-group arithmetic of a layout's mesh (sample x channel x filter, row-major)."""

from __future__ import annotations

from functools import lru_cache

from hybridpar.layout.layer import LayerLayout

Groups = tuple[tuple[int, ...], ...]


def rank_of(i_s: int, i_c: int, i_f: int, layout: LayerLayout) -> int:
    return (i_s * layout.channel + i_c) * layout.filter + i_f


@lru_cache(maxsize=1024)
def filter_groups(layout: LayerLayout) -> Groups:
    """f consecutive ranks: same sample group, same grid row (stationary-y/-w gather the input here)."""
    n, f = layout.size, layout.filter
    return tuple(tuple(range(b, b + f)) for b in range(0, n, f))


@lru_cache(maxsize=1024)
def channel_groups(layout: LayerLayout) -> Groups:
    """c ranks f apart: same sample group, same grid column (stationary-x/-w reduce-scatter here)."""
    c, f, g = layout.channel, layout.filter, layout.channel * layout.filter
    return tuple(tuple(base + j + i * f for i in range(c)) for base in range(0, layout.size, g) for j in range(f))


@lru_cache(maxsize=1024)
def sample_groups(layout: LayerLayout) -> Groups:
    """The G consecutive ranks sharing one block of samples."""
    g = layout.g_size
    return tuple(tuple(range(b, b + g)) for b in range(0, layout.size, g))


@lru_cache(maxsize=1024)
def shard_groups(layout: LayerLayout) -> Groups:
    """Ranks holding the same weight shard (and the same channel slice): the segmented allreduce."""
    g = layout.g_size
    return tuple(tuple(range(k, layout.size, g)) for k in range(g))
