"""Shared fixtures for the graph tests: FlopCounterMode measurement of a training step."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode


def _tensors(y) -> list[torch.Tensor]:
    if isinstance(y, torch.Tensor):
        return [y]
    return [t for t in y if isinstance(t, torch.Tensor)]


def measured_flops(module: torch.nn.Module, inputs: tuple) -> tuple[int, int]:
    """(forward, backward) FLOPs that torch.utils.flop_counter counts for one training step."""
    with FlopCounterMode(display=False) as fwd:
        y = module(*inputs)
    with FlopCounterMode(display=False) as bwd:
        sum(t.float().sum() for t in _tensors(y)).backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


@pytest.fixture
def flop_counter():
    return measured_flops
