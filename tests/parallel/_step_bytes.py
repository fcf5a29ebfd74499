"""The rank function both spatial bytes tests share (tests/parallel/test_spatial_plan_bytes.py and
test_spatial_gather_bytes.py): each rank's bytes per kind in the second training step of a model under
a strategy (the first sets DTensor's caches up), DTensor's redistributions included, as `hybridpar
train` logs them (train.engine does the same)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hybridpar

Case = Callable[[str], tuple[nn.Module, torch.Tensor, torch.Tensor]]


def second_step_bytes(case: Case, cases: list[tuple[str, str]]) -> list[list[dict[str, int]]]:
    """Per (factory, strategy): every rank's bytes per kind in the second step; `case(factory)` gives
    the unsplit model, its input and its labels."""
    from hybridpar.parallel.dtensor.log import recording

    out = []
    for factory, strategy in cases:
        model, x, y = case(factory)
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
