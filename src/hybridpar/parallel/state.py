"""Where each rank's parameter and buffer shards sit in the undistributed tensors, and gathering them
back into the undistributed model's state_dict layout (for --save and checks): the one state gather
of the package, for `parallelize`'s layouts and the model-parallel engine alike."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridpar.parallel.comm.log import CommLog


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


def gather_full_state(local_state: Mapping[str, torch.Tensor], shards: Mapping[str, ShardInfo | None],
                      log: CommLog | None = None, *, everywhere: bool = False) -> dict[str, torch.Tensor] | None:
    """Collective over the world: the undistributed state_dict on rank 0 (others None), or on every
    rank with `everywhere`. Tensor by tensor (in state_dict order, the same on every rank), so the
    receiver holds the tensors assembled so far plus one tensor's pieces, never every rank's whole
    state at once: DTensor entries are made whole by DTensor; entries named in `shards` are gathered
    and placed (a None shard: this rank contributes nothing to that entry, as a model-parallel stage
    that does not own it); everything else is this rank's own copy (replicated)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    keep = everywhere or rank == 0
    out: dict[str, torch.Tensor] = {}
    sent = 0
    for name, v in local_state.items():
        if isinstance(v, DTensor) and name in shards:  # a local shard FSDP holds over the sample ranks:
            v = v.full_tensor()  # this rank's whole piece first (collective over its sample ranks)
        if isinstance(v, DTensor):
            whole = v.full_tensor().detach().cpu()
            if keep:
                out[name] = whole
        elif name in shards:
            info = shards[name]
            piece = None if info is None else (v.detach().cpu(), info)
            if piece is not None:
                sent += piece[0].numel() * piece[0].element_size()
            got: list[tuple[torch.Tensor, ShardInfo] | None] | None = [None] * world if keep else None
            if everywhere:
                dist.all_gather_object(got, piece)
            else:
                dist.gather_object(piece, got, dst=0)
            if keep and got is not None:
                held = [p for p in got if p is not None]
                full = torch.zeros(held[0][1].full_shape, dtype=held[0][0].dtype)
                for t, i in held:
                    place(full, t, i)
                out[name] = full
        elif keep:
            out[name] = v.detach().cpu().clone()
    if log is not None:
        log.record("gather", world, sent, "full_state_dict", setup=True)
    return out if keep else None
