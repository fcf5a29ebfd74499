"""Collectives along one tensor dimension, on a grid Group, each recorded in a CommLog.

Uneven pieces are supported: gloo's all_gather needs equal sizes, so pieces are padded to the
largest for the transfer, while the log records the logical bytes (the cost model's figure).
Each call records its wall time on this rank (CommLog.timed), so a step's communication time can be
measured per kind beside the cost model's prediction."""

from __future__ import annotations

from math import prod

import torch
import torch.distributed as dist

from hybridpar.runtime.comm_log import CommLog
from hybridpar.runtime.grid import Group


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def concat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat by copies: the runtime's own concatenations must not be mistaken for a model's
    channel concatenation by hybridpar.runtime.layers.concat.ChannelCatMode."""
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    out = parts[0].new_empty(shape)
    off = 0
    for p in parts:
        out.narrow(dim, off, p.shape[dim]).copy_(p)
        off += p.shape[dim]
    return out


def all_gather_dim(t: torch.Tensor, dim: int, group: Group, sizes: list[int], log: CommLog,
                   tag: str = "") -> torch.Tensor:
    """Concatenate along `dim` the pieces held by the group's ranks (piece k has sizes[k] there)."""
    if group.size == 1:
        return t
    big = max(sizes)
    # One flat buffer [G, *piece] (all_gather_single): gloo's list form copies every piece in and
    # out of its own flat buffer, and was measured slower in-step.
    shape = list(t.shape)
    shape[dim] = big
    buf = t.contiguous() if t.shape[dim] == big else _padded(t, dim, big)
    out = t.new_empty([group.size, *shape])
    full_shape = list(t.shape)
    full_shape[dim] = sum(sizes)
    with log.timed("allgather", group.size, prod(full_shape) * t.element_size(), tag):
        dist.all_gather_single(out.flatten(0, 1), buf, group=group.pg)  # gloo: pieces along dim 0
    return concat([o.narrow(dim, 0, n) for o, n in zip(out.unbind(0), sizes)], dim)


def reduce_scatter_dim(t: torch.Tensor, dim: int, group: Group, sizes: list[int], log: CommLog,
                       tag: str = "") -> torch.Tensor:
    """Sum `t` over the group and keep this rank's piece along `dim` (piece k has sizes[k])."""
    if group.size == 1:
        return t
    big = max(sizes)
    shape = list(t.shape)
    shape[dim] = big
    # Pieces side by side in one [G, *piece] buffer (reduce_scatter_single); gloo's list form was
    # measured up to 3x slower in-step at 4 ranks. Uneven pieces are padded with zeros.
    ins = t.new_zeros([group.size, *shape]) if min(sizes) != big else t.new_empty([group.size, *shape])
    off = 0
    for k, n in enumerate(sizes):
        ins[k].narrow(dim, 0, n).copy_(t.narrow(dim, off, n))
        off += n
    out = t.new_empty(shape)
    with log.timed("reduce_scatter", group.size, _nbytes(t), tag):
        dist.reduce_scatter_single(out, ins.flatten(0, 1), group=group.pg)
    return out.narrow(dim, 0, sizes[group.index]) if sizes[group.index] != big else out


def _padded(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = n
    buf = t.new_zeros(shape)
    buf.narrow(dim, 0, t.shape[dim]).copy_(t)
    return buf


def all_reduce_(t: torch.Tensor, group: Group, log: CommLog, tag: str = "", async_op: bool = False):
    """In-place sum over the group. With async_op, returns the work handle (None for 1 rank)."""
    if group.size == 1:
        return None
    if async_op:  # only issued here: the wait happens elsewhere, so there is no time to record
        work = dist.all_reduce(t, group=group.pg, async_op=True)
        log.record("allreduce", group.size, _nbytes(t), tag)
        return work
    with log.timed("allreduce", group.size, _nbytes(t), tag):
        dist.all_reduce(t, group=group.pg)
    return None


def all_to_all_flat(sends: list[torch.Tensor], send_sizes: list[int], recv_sizes: list[int],
                    like: torch.Tensor, group: Group | None, log: CommLog, tag: str = "") -> torch.Tensor:
    """One all_to_all_single: the flat `sends` (send_sizes[q] elements for rank q of the group, in
    order) go out; what arrives comes back flat, in sender order (recv_sizes[q] from rank q).
    group=None: the whole world. Logged as the bytes this rank sends to the other ranks."""
    pg, index, size = (None, dist.get_rank(), dist.get_world_size()) if group is None else \
        (group.pg, group.index, group.size)
    flat_in = torch.cat(sends) if sends else like.new_empty(0)
    flat_out = like.new_empty(sum(recv_sizes))
    with log.timed("alltoall", size, (sum(send_sizes) - send_sizes[index]) * like.element_size(), tag):
        dist.all_to_all_single(flat_out, flat_in, recv_sizes, send_sizes, group=pg)
    return flat_out
