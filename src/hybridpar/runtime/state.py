"""Where each rank's parameter and buffer shards sit in the undistributed tensors, and gathering them
back into the undistributed model's state_dict layout (for --save and checks)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ShardInfo:
    """full_shape of the undistributed tensor; per leading dim, the (offset, size) ranges this shard
    concatenates (None = the whole dim). Dims past len(dims) are whole."""

    full_shape: tuple[int, ...]
    dims: tuple[tuple[tuple[int, int], ...] | None, ...]


def place(full: torch.Tensor, shard: torch.Tensor, info: ShardInfo) -> None:
    """Write `shard` into its ranges of `full`."""
    per_dim = []
    for d, rs in enumerate(info.dims):
        rs = rs if rs is not None else ((0, info.full_shape[d]),)
        local, acc = [], 0
        for off, n in rs:
            local.append((off, acc, n))
            acc += n
        per_dim.append(local)
    for combo in itertools.product(*per_dim):
        dst, src = full, shard
        for d, (off, loc, n) in enumerate(combo):
            dst = dst.narrow(d, off, n)
            src = src.narrow(d, loc, n)
        dst.copy_(src)


def take(full: torch.Tensor, info: ShardInfo | None) -> torch.Tensor:
    """The piece of `full` that `info` describes (the inverse of `place`; None: all of it)."""
    if info is None:
        return full
    out = full
    for d, rs in enumerate(info.dims):
        if rs is not None:
            out = torch.cat([out.narrow(d, off, n) for off, n in rs], dim=d)
    return out


def gather_full_state(local_state: dict[str, torch.Tensor], shards: dict[str, ShardInfo],
                      log=None, *, everywhere: bool = False) -> dict[str, torch.Tensor] | None:
    """Collective over the world: the undistributed state_dict on rank 0 (others None), or on every
    rank with `everywhere`. DTensor entries are made whole by DTensor; local shards of our parallel
    layers are gathered and placed; everything else is this rank's own copy (replicated)."""
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    whole = {k: v.full_tensor().detach().cpu() for k, v in local_state.items() if isinstance(v, DTensor)}
    payload = {k: (v.detach().cpu(), shards[k]) for k, v in local_state.items() if k in shards}
    if everywhere:
        got = [None] * world
        dist.all_gather_object(got, payload)
    else:
        got = [None] * world if rank == 0 else None
        dist.gather_object(payload, got, dst=0)
    if log is not None:
        log.record("gather", world, sum(t.numel() * t.element_size() for t, _ in payload.values()),
                   "full_state_dict", setup=True)
    if got is None:
        return None
    out: dict[str, torch.Tensor] = {}
    for name, v in local_state.items():
        if name in whole:
            out[name] = whole[name]
        elif name in payload:
            info = payload[name][1]
            full = torch.zeros(info.full_shape, dtype=v.dtype)
            for p in got:
                t, i = p[name]
                place(full, t, i)
            out[name] = full
        else:
            out[name] = v.detach().cpu().clone()
    return out
