"""FSDP-sharded tensors (`zero=2|3`, hybridpar.parallel.fsdp) in checkpoints (hybridpar.train.checkpoint):
each rank writes only its FSDP shard, described by a ShardInfo like any other piece (and so written as
chunks of the full tensor, hybridpar.train.checkpoint_dcp), so a checkpoint saved under `sample=2,zero=3`
resumes under `sample=2`, one rank or `sample=2,channel=2,zero=3` through the same resharding.

An FSDP2 parameter (and its optimizer slots) is a DTensor on the plan's `sample` mesh dimension,
Shard(0), over what the rank would hold without sharding: the whole tensor (sample-only layouts) or
this rank's channel/filter piece (its ShardInfo). The rows of that it holds are DTensor's even-chunk
split (FSDP2's); composing them with the piece's ranges gives the shard's place in the undistributed
tensor. (No DTensor placement says this: the piece under the FSDP shard is itself an uneven or strided
cut of the parameter. DCP's storage does not need one: a ShardInfo is a product of ranges, i.e. boxes,
and each box is a DCP chunk.)"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from hybridpar.parallel.state import ShardInfo

__all__ = ["compose", "fsdp_shards", "is_fsdp_shard", "like_shard"]


def is_fsdp_shard(t: object) -> bool:
    """A DTensor FSDP2 holds on the sample dimension (hybridpar.parallel.fsdp)."""
    return (isinstance(t, DTensor) and tuple(t.device_mesh.mesh_dim_names or ()) == ("sample",)
            and tuple(t.placements) == (Shard(0),))


def compose(base: ShardInfo | None, whole: tuple[int, ...], start: int, rows: int) -> ShardInfo:
    """Where rows [start, start + rows) of dim 0 of a piece sit in the undistributed tensor: `base` is
    the piece's ShardInfo (None: the piece is the whole tensor, of shape `whole`)."""
    if base is None:
        return ShardInfo(tuple(whole), (((start, rows),),))
    ranges = base.dims[0] if base.dims and base.dims[0] is not None else ((0, base.full_shape[0]),)
    out: list[tuple[int, int]] = []
    pos, end = 0, start + rows  # positions along the piece's concatenated ranges
    for off, n in ranges:
        lo, hi = max(start, pos), min(end, pos + n)
        if hi > lo:
            out.append((off + lo - pos, hi - lo))
        pos += n
    return ShardInfo(base.full_shape, (tuple(out) or ((0, 0),), *base.dims[1:]))


def fsdp_shards(tensors: dict[str, torch.Tensor], shards: dict[str, ShardInfo | None]) -> dict[str, ShardInfo | None]:
    """`shards` with every FSDP-sharded tensor's entry narrowed to this rank's FSDP shard."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = dict(shards)
    for name, t in tensors.items():
        if is_fsdp_shard(t) and t.dim() > 0:
            assert isinstance(t, DTensor)
            local, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            out[name] = compose(shards.get(name), tuple(t.shape), offset[0], local[0])
    return out


def like_shard(p: DTensor, v: torch.Tensor) -> DTensor:
    """An optimizer slot for FSDP parameter `p` from this rank's stored shard `v`."""
    return DTensor.from_local(v.to(p.device).clone(), p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())
