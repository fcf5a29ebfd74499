"""Shard arithmetic (no processes): pieces, grid positions, weight blocks and their reassembly."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpar.layout import GridPos, piece_offsets, piece_sizes, ranges
from hybridpar.parallel.state import ShardInfo, place
from hybridpar.parallel.styles.conv import ConvGeometry, weight_block


@settings(deadline=None)  # the first call imports torch.distributed.tensor
@given(n=st.integers(0, 100), p=st.integers(1, 16))
def test_piece_sizes_are_dtensor_shards(n, p):
    """A rank's piece is exactly its DTensor Shard: the runtime wraps local pieces as DTensors."""
    from torch.distributed.tensor import Shard

    sizes = piece_sizes(n, p)
    offs = piece_offsets(n, p)
    for k in range(p):
        size, off = Shard.local_shard_size_and_offset(n, p, k)
        assert sizes[k] == size
        assert size == 0 or offs[k] == off
    assert offs == [sum(sizes[:k]) for k in range(p)]


@settings(max_examples=40)
@given(c=st.integers(1, 4), f=st.integers(1, 4), cin=st.integers(1, 13), cout=st.integers(1, 13))
def test_weight_blocks_partition_the_weight(c, f, cin, cout):
    """Every weight element lands on exactly one rank of the P_C x P_F grid, and place() puts the
    blocks back where they came from."""
    P = c * f
    w = torch.randn(cout, cin, 3, 3)
    rebuilt = torch.full_like(w, float("nan"))
    count = torch.zeros_like(w)
    in_s, out_s = piece_sizes(cin, P), piece_sizes(cout, P)
    for g in range(P):
        pos = GridPos(c, f, g)
        blk = weight_block(w, pos, in_s, out_s)
        info = ShardInfo(tuple(w.shape), (tuple(ranges(out_s, pos.out_piece_ids())),
                                          tuple(ranges(in_s, pos.in_piece_ids()))))
        place(rebuilt, blk, info)
        place(count, torch.ones_like(blk), info)
    assert torch.equal(rebuilt, w)
    assert torch.all(count == 1)


def test_stationary_w_output_piece_is_the_ranks_own():
    """Reduce-scatter in the channel group hands rank (i, j) output piece i*P_F + j = g."""
    for c, f in [(2, 2), (2, 3), (4, 2)]:
        for g in range(c * f):
            pos = GridPos(c, f, g)
            assert pos.out_piece_ids()[pos.i] == g
            assert pos.in_piece_ids()[pos.j] == g


def test_conv_output_size_formula_matches_torch():
    for h, k, s, p, d in [(9, 3, 2, 1, 1), (7, 7, 2, 3, 1), (12, 3, 1, 0, 2), (5, 1, 2, 0, 1)]:
        geo = ConvGeometry((s, s), (p, p), (d, d))
        y = torch.nn.functional.conv2d(torch.zeros(1, 1, h, h), torch.zeros(1, 1, k, k), None, s, p, d)
        assert geo.out_hw(h, h, k, k) == tuple(y.shape[2:])
