"""Collectives along one tensor dimension, on a grid Group, each recorded in a CommLog.

Uneven pieces are supported: gloo's all_gather needs equal sizes, so pieces are padded to the
largest for the transfer, while the log records the logical bytes (the cost model's figure)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridpar.runtime.comm_log import CommLog
from hybridpar.runtime.grid import Group


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def concat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat by copies: the runtime's own concatenations must not be mistaken for a model's
    channel concatenation by hybridpar.runtime.channel_ops.ChannelCatMode."""
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
    pad = list(t.shape)
    pad[dim] = big
    buf = t.new_zeros(pad)
    buf.narrow(dim, 0, t.shape[dim]).copy_(t)
    outs = [torch.empty_like(buf) for _ in sizes]
    dist.all_gather(outs, buf, group=group.pg)
    full = concat([o.narrow(dim, 0, n) for o, n in zip(outs, sizes)], dim)
    log.record("allgather", group.size, _nbytes(full), tag)
    return full


def reduce_scatter_dim(t: torch.Tensor, dim: int, group: Group, sizes: list[int], log: CommLog,
                       tag: str = "") -> torch.Tensor:
    """Sum `t` over the group and keep this rank's piece along `dim` (piece k has sizes[k])."""
    if group.size == 1:
        return t
    ins = [p.contiguous() for p in torch.split(t, sizes, dim=dim)]
    out = torch.empty_like(ins[group.index])
    dist.reduce_scatter(out, ins, group=group.pg)
    log.record("reduce_scatter", group.size, _nbytes(t), tag)
    return out


def all_reduce_(t: torch.Tensor, group: Group, log: CommLog, tag: str = "", async_op: bool = False):
    """In-place sum over the group. With async_op, returns the work handle (None for 1 rank)."""
    if group.size == 1:
        return None
    work = dist.all_reduce(t, group=group.pg, async_op=async_op)
    log.record("allreduce", group.size, _nbytes(t), tag)
    return work
