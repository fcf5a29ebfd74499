"""Models and the rank function of tests/parallel/test_spatial_plan_bytes.py: the bytes each rank
sends per kind in one training step under spatial x channel/filter layouts (our layers' collectives
and DTensor's own, as `hybridpar train` logs them), to set beside `hybridpar plan --json`'s
`predicted.comm_bytes`. The factories are `--model` targets (path:factory)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

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


def _case(factory: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = globals()[factory]()
    torch.manual_seed(1)
    x = torch.randn(BATCH, *SHAPES[factory])
    with torch.no_grad():
        out = model(x)
    return model, x, torch.randint(0, 2, out.shape[:1] + out.shape[2:])


def step_bytes(cases: list[tuple[str, str]]) -> list[list[dict[str, int]]]:
    """Per (factory, strategy): each rank's bytes per kind in the second training step. Imported here:
    `plan --model path:factory` loads this file outside its package."""
    from ._step_bytes import second_step_bytes

    return second_step_bytes(_case, cases)
