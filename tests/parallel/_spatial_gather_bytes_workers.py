"""Models and the rank function of tests/parallel/test_spatial_gather_bytes.py: the bytes each rank
sends per kind in one training step of a 3-D CNN under depth=2 and a 2-D one under width=2, whose
adaptive pools the runtime runs on the spatially whole input (DTensor's allgather over the spatial
ranks) or as a global average (an allreduce), as `hybridpar train` logs them. The factories are
`--model` targets (path:factory)."""

from __future__ import annotations

import torch
from torch import nn

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


def _case(factory: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = globals()[factory]()
    torch.manual_seed(1)
    return model, torch.randn(BATCH, *SHAPES[factory]), torch.randint(0, 3, (BATCH,))


def step_bytes(cases: list[tuple[str, str]]) -> list[list[dict[str, int]]]:
    """Per (factory, strategy): each rank's bytes per kind in the second training step. Imported here:
    `plan --model path:factory` loads this file outside its package."""
    from ._step_bytes import second_step_bytes

    return second_step_bytes(_case, cases)
