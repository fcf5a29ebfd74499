"""The rank loop the spatial and DTensor bytes tests share (tests/parallel/test_spatial_plan_bytes.py,
test_spatial_gather_bytes.py, test_dtensor_log_bytes.py): a model under a strategy, one training step
to set DTensor's caches up, then the bytes of the second, as `hybridpar train` logs them (train.engine
does the same: our layers' collectives and DTensor's redistributions)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hybridpar

Case = Callable[[str], tuple[nn.Module, torch.Tensor, torch.Tensor]]


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, opt, log) -> None:
    """One SGD step with cross-entropy, its collectives recorded in `log` (a fresh step's bytes)."""
    from hybridpar.parallel.dtensor.log import recording

    log.mark_step()
    with recording(log):
        F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def second_step_bytes(case: Case, cases: list[tuple[str, str]],
                      measure: Callable[[Callable[[], None], object], dict] | None = None) -> list[list[dict]]:
    """Per (factory, strategy), every rank's figures of the second step; `case(factory)` gives the
    unsplit model, its input and its labels. `measure(step, log)` runs the step and returns what to
    gather (default: the log's bytes per kind)."""
    out = []
    for factory, strategy in cases:
        model, x, y = case(factory)
        hybridpar.parallelize(model, strategy)
        log = model.hybridpar.grid.comm_log
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(model=model, x=x, y=y, opt=opt, log=log) -> None:
            train_step(model, x, y, opt, log)
        step()
        if measure is None:
            step()
            mine = log.step_bytes_by_kind()
        else:
            mine = measure(step, log)
        got: list = [None] * dist.get_world_size()
        dist.all_gather_object(got, mine)
        out.append(got)
    return out
