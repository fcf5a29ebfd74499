"""Models and the rank function of tests/parallel/test_spatial_plan_bytes.py: the bytes each rank
sends per kind in one training step under spatial x channel/filter layouts (our layers' collectives
and DTensor's own, as `hybridpar train` logs them), to set beside `hybridpar plan --json`'s
`predicted.comm_bytes`. The factories are `--model` targets (path:factory)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hybridpar

BATCH = 4
SHAPES = {"tiny_net": (3, 3, 9), "dilated": (3, 29, 19)}


def tiny_net() -> nn.Module:
    """tests/parallel/_spatial_compose_workers.tiny's CNN in fp32: a 7x7 conv whose 3-row halo exceeds
    the 2- and 1-row pieces, uneven channel pieces, batch norm, max pool, a strided conv; per-pixel
    logits out (gathered spatially and over channels for the loss)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 5, 7, padding=3), nn.BatchNorm2d(5), nn.ReLU(), nn.MaxPool2d(3, stride=1, padding=1),
        nn.Conv2d(5, 3, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(3, 4, 1))


def dilated() -> nn.Module:
    """tests/parallel/_spatial_model_workers.Dilated: dilated convs with residual adds, batch norm, avg
    pooling, a grouped conv (whole on channel_filter: DTensor gathers its input), global average
    pooling (its allreduce over the spatial ranks) and a Linear head (DTensor's, replicated)."""
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.parallel._spatial_model_workers import Dilated

    torch.manual_seed(0)
    return Dilated()


def step_bytes(cases: list[tuple[str, str]]) -> list[list[dict[str, int]]]:
    """Per (factory, strategy): each rank's bytes per kind in the second training step (the first
    sets DTensor's caches up), DTensor's redistributions included (train.engine logs them too)."""
    from hybridpar.parallel.dtensor.log import recording

    out = []
    for factory, strategy in cases:
        model = globals()[factory]()
        torch.manual_seed(1)
        x = torch.randn(BATCH, *SHAPES[factory])
        with torch.no_grad():
            y = torch.randint(0, 2, model(x).shape[:1] + model(x).shape[2:])
        hybridpar.parallelize(model, strategy)
        log = model.hybridpar.grid.comm_log
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(2):
            log.mark_step()
            with recording(log):
                F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        got: list = [None] * dist.get_world_size()
        dist.all_gather_object(got, log.step_bytes_by_kind())
        out.append(got)
    return out
