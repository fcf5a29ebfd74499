"""Redistribution of an activation between two layouts (sample-split <-> channel-split <->
replicated within a group), as one all_to_all: every rank sends each other rank exactly the block
(sample range x channel range) it holds and the other needs, so the fewest bytes move. Its backward
is the inverse redistribution of the gradient."""

from __future__ import annotations

from math import prod

import torch
import torch.distributed as dist

from hybridpar.layout import Split, overlap
from hybridpar.parallel.comm.collectives import all_to_all_flat
from hybridpar.parallel.comm.log import CommLog


def redistribute(x: torch.Tensor, n: int, c: int, src: Split, dst: Split, log: CommLog, tag: str) -> torch.Tensor:
    """This rank's part under `dst` of the global [n, c, ...] tensor whose `src` part is `x`."""
    return _Redistribute.apply(x, n, c, src, dst, log, tag)


def _move(x: torch.Tensor, n: int, c: int, src: Split, dst: Split, log: CommLog, tag: str) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    inner = tuple(x.shape[2:])
    mine, want = src.box(rank, n, c), dst.box(rank, n, c)
    sends, send_sizes = [], []
    for q in range(world):
        o = overlap(mine, dst.box(q, n, c))
        block = x[o[0] - mine[0]:o[1] - mine[0], o[2] - mine[2]:o[3] - mine[2]] if o else x[:0, :0]
        sends.append(block.reshape(-1))
        send_sizes.append(block.numel())
    boxes = [overlap(src.box(r, n, c), want) for r in range(world)]
    recv_sizes = [0 if o is None else (o[1] - o[0]) * (o[3] - o[2]) * prod(inner) for o in boxes]
    out_flat = all_to_all_flat(sends, send_sizes, recv_sizes, x, None, log, tag)
    out = x.new_empty(want[1] - want[0], want[3] - want[2], *inner)
    for o, part in zip(boxes, out_flat.split(recv_sizes)):
        if o is not None:
            out[o[0] - want[0]:o[1] - want[0], o[2] - want[2]:o[3] - want[2]] = part.view(
                o[1] - o[0], o[3] - o[2], *inner)
    return out


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n, c, src, dst, log, tag):
        ctx.args = (n, c, src, dst, log, tag)
        return _move(x.contiguous(), n, c, src, dst, log, f"{tag}:fwd")

    @staticmethod
    def backward(ctx, d):
        n, c, src, dst, log, tag = ctx.args
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        return _move(d.contiguous(), n, c, dst, src, log, f"{tag}:bwd"), None, None, None, None, None, None
