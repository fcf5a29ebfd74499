"""Rank functions for tests/parallel/test_spatial.py (importable by spawned ranks)."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridpar.layout.pieces import piece_offsets, piece_sizes
from hybridpar.parallel.comm.log import CommLog
from hybridpar.parallel.mesh import Group
from hybridpar.parallel.styles.spatial import Halo, Sliding, SpatialSplit, spatial_conv, spatial_pool


def _groups(grid: tuple[int, ...]) -> list[Group]:
    """One group per split dim of a row-major grid over the split dims (every rank creates all)."""
    rank = dist.get_rank()
    coords = list(itertools.product(*[range(n) for n in grid]))
    mine = coords[rank]
    out = []
    for axis in range(len(grid)):
        pick = None
        for fixed in itertools.product(*[range(n) for i, n in enumerate(grid) if i != axis]):
            ranks = tuple(r for r, c in enumerate(coords)
                          if tuple(v for i, v in enumerate(c) if i != axis) == fixed)
            pg = dist.new_group(list(ranks)) if len(ranks) > 1 else None
            if rank in ranks:
                pick = Group(ranks, pg, ranks.index(rank))
        out.append(pick)
    del mine
    return out


def _piece(t: torch.Tensor, dims: list[int], grid: tuple[int, ...], coord: tuple[int, ...]) -> torch.Tensor:
    for d, p, i in zip(dims, grid, coord):
        t = t.narrow(d, piece_offsets(t.shape[d], p)[i], piece_sizes(t.shape[d], p)[i])
    return t


def case(spec: dict) -> float:
    """Max abs error (over ranks) of one spatially split conv/pool against the whole op, forward,
    input gradient and (after the spatial allreduce) weight and bias gradients, in float64."""
    torch.manual_seed(0)
    dims, grid = spec["dims"], tuple(spec["grid"])
    nd = len(spec["size"])
    x = torch.randn(2, spec.get("cin", 3), *spec["size"], dtype=torch.float64)
    coord = list(itertools.product(*[range(n) for n in grid]))[dist.get_rank()]
    groups = _groups(grid)
    splits = [SpatialSplit(d, g) for d, g in zip(dims, groups)]
    xl = _piece(x, dims, grid, coord).clone().requires_grad_(True)
    xg = x.clone().requires_grad_(True)
    log = CommLog()
    if spec["op"] == "conv":
        cin, cout, groups_ = spec.get("cin", 3), spec.get("cout", 4), spec.get("groups", 1)
        w = torch.randn(cout, cin // groups_, *([spec["k"]] * nd), dtype=torch.float64)
        b = torch.randn(cout, dtype=torch.float64)
        wl, bl = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
        wg, bg = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
        kw = {"stride": spec.get("s", 1), "padding": spec.get("p", 0), "dilation": spec.get("d", 1),
              "groups": groups_}
        geom = Sliding.of(nd, spec["k"], kw["stride"], kw["padding"], kw["dilation"], groups_)
        yl = spatial_conv(xl, wl, bl, geom, Halo(tuple(splits), tuple(spec["size"]), log))
        yg = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd](xg, wg, bg, **kw)
    else:
        kw = {"kernel_size": spec["k"], "stride": spec.get("s"), "padding": spec.get("p", 0)}
        if spec["op"] == "max":
            kw["dilation"] = spec.get("d", 1)
        geom = Sliding.of(nd, spec["k"], spec.get("s"), spec.get("p", 0), spec.get("d", 1))
        yl = spatial_pool(xl, spec["op"], geom, Halo(tuple(splits), tuple(spec["size"]), log))
        fn = getattr(F, f"{spec['op']}_pool{nd}d")
        yg = fn(xg, **kw)
    gy = torch.randn_like(yg)
    (yg * gy).sum().backward()
    (yl * _piece(gy, dims, grid, coord)).sum().backward()
    errs = [(yl - _piece(yg, dims, grid, coord)).abs().max() if yl.numel() else torch.zeros((), dtype=torch.float64),
            (xl.grad - _piece(xg.grad, dims, grid, coord)).abs().max() if xl.numel()
            else torch.zeros((), dtype=torch.float64)]
    if spec["op"] == "conv":
        for local, whole in ((wl, wg), (bl, bg)):
            g = local.grad.clone()
            dist.all_reduce(g)  # the weight is replicated over the spatial group: partial sums
            errs.append((g - whole.grad).abs().max())
    err = torch.stack(errs).detach().max().reshape(1)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    sent = torch.tensor([sum(r.bytes_ for r in log.records if r.kind == "halo")], dtype=torch.float64)
    dist.all_reduce(sent)
    return float(err), float(sent)


def cases(specs: list[dict]) -> list[tuple[float, float]]:
    return [case(spec) for spec in specs]
