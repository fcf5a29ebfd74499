"""The decomposition space of one layer: sample × channel × filter splits of G ranks.

Every choice of a weight layer is a `LayerLayout(sample=s, channel=c, filter=f)` with s·c·f = G:
sample-only (c = f = 1), stationary-x (c > 1), stationary-y (f > 1), stationary-w (both), each
composed with s sample groups; for FC layers, c is the row split (in_features) and f the column split
(out_features). At a layer boundary the activation is split s ways on samples and c·f ways on
channels (`Distribution`), which is what neighbouring layers must agree on or pay a redistribution.

Rank convention (shared with the cost of every collective): rank = (i_s·c + i_c)·f + i_f, so a filter
group is f consecutive ranks, a channel group is c ranks f apart (consecutive when f = 1), and the ranks
holding the same weight shard — the segmented-allreduce group — are c·f apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from hybridpar.layout.groups import (  # noqa: F401 - the one vocabulary's rank groups, re-exported here
    Groups,
    channel_groups,
    filter_groups,
    rank_of,
    shard_groups,
)
from hybridpar.plans import LayerLayout


@dataclass(frozen=True, order=True)
class Distribution:
    """How an activation tensor is spread: `sample` ways on the batch, `channel` ways on channels."""

    sample: int
    channel: int


@dataclass(frozen=True)
class Pruned:
    layout: LayerLayout
    reason: str


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@lru_cache(maxsize=4096)
def layout_of(sample: int, channel: int = 1, filter: int = 1) -> LayerLayout:
    """A LayerLayout, built once per degrees (a frozen pydantic model: validating one costs more than
    pricing a collective from the planner's caches)."""
    return LayerLayout(sample=sample, channel=channel, filter=filter)


def distribution_of(layout: LayerLayout) -> Distribution:
    return Distribution(layout.sample, layout.channel * layout.filter)


def all_layouts(ranks: int) -> list[LayerLayout]:
    """All (s, c, f) with s·c·f = ranks, sample-only first."""
    out = []
    for c in divisors(ranks):
        for f in divisors(ranks // c):
            out.append(LayerLayout(sample=ranks // (c * f), channel=c, filter=f))
    return sorted(out, key=lambda lay: (lay.channel * lay.filter, lay.channel, lay.filter))


def layout_problem(layout: LayerLayout, batch: int, in_channels: int, out_channels: int,
                   splittable: bool = True, even: bool = False, empty_ok: bool = False) -> str | None:
    """Why `layout` cannot run this layer, or None if it can. Uneven channel pieces are allowed
    (pieces differ by one) unless `even`; more groups than channels only if `empty_ok` (the runtime
    runs them with empty pieces; the search prunes them as wasted ranks)."""
    s, c, f = layout.sample, layout.channel, layout.filter
    if batch % s:
        return f"batch {batch} not divisible into {s} sample groups"
    if not splittable and c * f > 1:
        return "grouped/depthwise layer: sample split only"
    if empty_ok:
        return None
    if c > in_channels:
        return f"more channel groups ({c}) than input channels ({in_channels})"
    if f > out_channels:
        return f"more filter groups ({f}) than filters ({out_channels})"
    if c * f > out_channels:
        return f"output split into more pieces ({c * f}) than its {out_channels} channels"
    if even and c > 1 and in_channels % c:
        return f"{in_channels} input channels not divisible by channel={c}"
    if even and f > 1 and out_channels % f:
        return f"{out_channels} filters not divisible by filter={f}"
    return None


def distributions(ranks: int, batch: int, channels: int) -> list[Distribution]:
    """Distributions of a tensor with `channels` channels over `ranks` ranks (joins choose among these)."""
    return [Distribution(ranks // p, p) for p in divisors(ranks)
            if batch % (ranks // p) == 0 and channels % p == 0]

