"""Rank function for tests/parallel/test_spatial_overlap.py: when a spatially split convolution's
interior runs, relative to its halo's arrival, with the peer's halo delayed."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridpar.parallel.comm.log import CommLog
from hybridpar.parallel.mesh import Group
from hybridpar.parallel.styles import spatial as S


def overlap_case(delay: float) -> dict:
    rank = dist.get_rank()
    events: list[tuple[str, float]] = []
    conv2d, wait = S._CONV[2], S._wait

    def conv(*args, **kwargs):
        events.append(("conv", time.monotonic()))
        return conv2d(*args, **kwargs)

    def waited(works):
        wait(works)
        events.append(("halo", time.monotonic()))

    S._CONV[2], S._wait = conv, waited
    try:
        torch.manual_seed(0)
        x = torch.randn(2, 3, 16, 9, dtype=torch.float64)
        w = torch.randn(4, 3, 3, 3, dtype=torch.float64)
        b = torch.randn(4, dtype=torch.float64)
        group = Group((0, 1), dist.group.WORLD, rank)
        xl = x.narrow(2, 8 * rank, 8).clone().requires_grad_(True)
        dist.barrier()
        start = time.monotonic()
        if rank == 1:
            time.sleep(delay)  # this rank's halo rows leave late
        halo = S.Halo((S.SpatialSplit(2, group),), (16, 9), CommLog())
        y = S.spatial_conv(xl, w, b, S.Sliding.of(2, 3, 1, 1), halo)
        whole = F.conv2d(x, w, b, padding=1).narrow(2, 8 * rank, 8)
        err = float((y.detach() - whole).abs().max())
        gy = torch.randn(2, 4, 16, 9, dtype=torch.float64)
        (y * gy.narrow(2, 8 * rank, 8)).sum().backward()
        xg = x.clone().requires_grad_(True)
        (F.conv2d(xg, w, b, padding=1) * gy).sum().backward()
        err = max(err, float((xl.grad - xg.grad.narrow(2, 8 * rank, 8)).abs().max()))
    finally:
        S._CONV[2], S._wait = conv2d, wait
    errs: list = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    return {"err": max(errs), "events": [(k, t - start) for k, t in events]}  # spawn returns rank 0's
