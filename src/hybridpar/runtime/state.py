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


def gather_full_state(local_state: dict[str, torch.Tensor], shards: dict[str, ShardInfo],
                      log=None) -> dict[str, torch.Tensor] | None:
    """Collective over the world: rank 0 gets the undistributed state_dict (others None).
    Only sample group 0 holds distinct shards, but every rank takes part in the gather."""
    payload = {k: (v.detach().cpu(), shards.get(k)) for k, v in local_state.items()}
    rank, world = dist.get_rank(), dist.get_world_size()
    got = [None] * world if rank == 0 else None
    dist.gather_object(payload, got, dst=0)
    if log is not None:
        log.record("gather", world, sum(t.numel() * t.element_size() for t, _ in payload.values()),
                   "full_state_dict", setup=True)
    if rank != 0:
        return None
    out: dict[str, torch.Tensor] = {}
    for name, (t0, info) in got[0].items():
        if info is None:
            out[name] = t0.clone()
            continue
        full = torch.zeros(info.full_shape, dtype=t0.dtype)
        for p in got:
            t, i = p[name]
            place(full, t, i)
        out[name] = full
    return out
