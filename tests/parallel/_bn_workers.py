"""Rank function for tests/parallel/test_batchnorm_stats.py (importable by spawned ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.parallel.comm.log import CommLog, bytes_by_kind
from hybridpar.parallel.mesh import Group
from hybridpar.parallel.styles.norm import DistBatchNorm, NormComm


def global_bn_step(x: torch.Tensor, dy: torch.Tensor) -> dict:
    """Each rank normalises its rows of x with global statistics; returns rank 0's view of everything
    gathered: outputs, input and parameter gradients (summed), running stats and the logged bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = x.shape[0] // world
    mine = slice(rank * rows, (rank + 1) * rows)
    bn = nn.BatchNorm2d(x.shape[1])
    log = CommLog()
    dist_bn = DistBatchNorm(bn, slice(None), NormComm(Group(tuple(range(world)), dist.group.WORLD, rank), log, "bn"))
    xl = x[mine].clone().requires_grad_(True)
    y = dist_bn(xl)
    y.backward(dy[mine])
    ys, dxs = [torch.empty_like(y) for _ in range(world)], [torch.empty_like(xl) for _ in range(world)]
    dist.all_gather(ys, y.detach().contiguous())
    dist.all_gather(dxs, xl.grad.contiguous())
    dw, db = dist_bn.weight.grad.clone(), dist_bn.bias.grad.clone()
    dist.all_reduce(dw)
    dist.all_reduce(db)
    return {"y": torch.cat(ys), "dx": torch.cat(dxs), "dw": dw, "db": db, "running_mean": dist_bn.running_mean,
            "running_var": dist_bn.running_var, "bytes": bytes_by_kind(log.records)}
