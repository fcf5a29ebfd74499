"""Models and the rank function of tests/parallel/test_spatial_gather_bytes.py: the bytes each rank
sends per kind in one training step of a 3-D CNN under depth=2 and a 2-D one under width=2, whose
adaptive pools the runtime runs on the spatially whole input (DTensor's allgather over the spatial
ranks) or as a global average (an allreduce), as `hybridpar train` logs them. The factories are
`--model` targets (path:factory)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hybridpar

BATCH = 4
SHAPES = {"cosmo_tiny": (2, 8, 8, 8), "pool_strip": (3, 9, 7)}


def cosmo_tiny() -> nn.Module:
    """CosmoFlow's pattern (benchmarks/_holdout_models.cosmoflow_32) in small: Conv3d, LeakyReLU,
    MaxPool3d, and an adaptive pool to 2^3 (SpatialGathered) before a flatten and a Linear head."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2),
                         nn.Conv3d(4, 4, 3, padding=1), nn.LeakyReLU(0.3), nn.AdaptiveAvgPool3d(2),
                         nn.Flatten(), nn.Linear(32, 3))


def pool_strip() -> nn.Module:
    """An adaptive average pool to 1 along the split dim only, (1, 3) over height x width: the runtime
    gathers its input (a global average needs 1 along every dim), no allreduce."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d((1, 3)),
                         nn.Flatten(), nn.Linear(12, 5))


def step_bytes(cases: list[tuple[str, str]]) -> list[list[dict[str, int]]]:
    """Per (factory, strategy): each rank's bytes per kind in the second training step (the first
    sets DTensor's caches up), DTensor's redistributions included (train.engine logs them too)."""
    from hybridpar.parallel.dtensor.log import recording

    out = []
    for factory, strategy in cases:
        model = globals()[factory]()
        torch.manual_seed(1)
        x = torch.randn(BATCH, *SHAPES[factory])
        y = torch.randint(0, 3, (BATCH,))
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
