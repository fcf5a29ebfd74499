"""The decomposition space: enumeration, pruning with reasons, and the rank groups of each algorithm."""

from __future__ import annotations

import pytest

from hybridpar.plans import LayerLayout
from hybridpar.search.layers.decomposition import (
    Distribution,
    all_layouts,
    channel_groups,
    distribution_of,
    filter_groups,
    layout_problem,
    shard_groups,
)


def test_all_layouts_cover_every_factorisation_once():
    lays = all_layouts(8)
    assert len(lays) == len(set(lays)) == 10  # ordered factorisations of 2^3 into 3 factors: C(5, 2)
    assert all(lay.size == 8 for lay in lays)
    assert lays[0] == LayerLayout(sample=8)


@pytest.mark.parametrize(("layout", "reason"), [
    (LayerLayout(sample=3), "batch 32 not divisible into 3 sample groups"),
    (LayerLayout(sample=1, channel=4), "more channel groups (4) than input channels (3)"),
    (LayerLayout(sample=1, filter=128), "more filter groups (128) than filters (64)"),
])
def test_pruned_layouts_keep_their_reason(layout, reason):
    assert layout_problem(layout, 32, 3, 64) == reason


def test_uneven_pieces_allowed_unless_even_required():
    lay = LayerLayout(sample=1, channel=2)
    assert layout_problem(lay, 8, 3, 64) is None
    assert "not divisible" in layout_problem(lay, 8, 3, 64, even=True)
    assert "depthwise" in layout_problem(lay, 8, 4, 4, splittable=False)


def test_groups_match_the_runtime_grid():
    import hybridpar.parallel.mesh as grid
    lay = LayerLayout(sample=2, channel=2, filter=2)
    sets = set(grid._rank_sets(2, 4, [(2, 2)]))
    for groups in (filter_groups(lay), channel_groups(lay), shard_groups(lay)):
        assert {tuple(g) for g in groups} <= sets
    assert filter_groups(lay)[0] == (0, 1)  # consecutive: inside a node when it fits
    assert channel_groups(lay)[0] == (0, 2)
    assert shard_groups(lay)[0] == (0, 4)
    for groups in (filter_groups(lay), channel_groups(lay), shard_groups(lay)):
        assert sorted(r for g in groups for r in g) == list(range(8))  # disjoint, cover the world
    assert distribution_of(lay) == Distribution(2, 4)
