"""Rank functions for tests/parallel/test_spatial_compose.py: a tiny CNN under spatial x channel/filter
layouts through `hybridpar.parallelize`, against one process (fp64), with the bytes each layer sent."""

from __future__ import annotations

import copy
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hybridpar


def tiny(dtype=torch.float64):
    """3 x 9 input over 2 height ranks: pieces of 2 and 1 rows, smaller than the 7x7 conv's 3-row halo;
    5 and 3 channels over G = 2: uneven channel pieces; a strided conv, a pool, a 1x1 conv, batch norm."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 5, 7, padding=3), nn.BatchNorm2d(5), nn.ReLU(), nn.MaxPool2d(3, stride=1, padding=1),
        nn.Conv2d(5, 3, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(3, 4, 1)).to(dtype)
    x = torch.randn(2, 3, 3, 9, dtype=dtype)
    y = torch.randint(0, 4, (2, 2, 5))
    return model, x, y


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def compose_case(strategy: str, steps: int = 2) -> dict:
    ref, x, y = tiny()
    model = copy.deepcopy(ref)
    hybridpar.parallelize(model, strategy)
    kinds = {type(m).__name__ for m in model.modules()}
    log = model.hybridpar.grid.comm_log
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    out_err = 0.0
    for _ in range(steps):
        log.mark_step()
        out, ref_out = model(x), ref(x)
        out_err = max(out_err, _err(out.detach(), ref_out.detach()))
        F.cross_entropy(out, y).backward()
        F.cross_entropy(ref_out, y).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    sent: dict[str, int] = defaultdict(int)  # "layer/kind/phase" -> bytes this rank sent in the last step
    for r in log.step_records():
        layer, _, phase = r.tag.rpartition(":")
        if r.kind in ("halo", "allgather", "reduce_scatter"):
            sent[f"{layer}/{r.kind}/{phase}"] += r.bytes_
    full = hybridpar.full_state_dict(model)
    w_err = max(_err(full[k], v) for k, v in ref.state_dict().items() if v.is_floating_point())
    rec = {"out": out_err, "weights": w_err, "sent": dict(sent), "kinds": sorted(kinds)}
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, rec)
    return {"ranks": got}


def compose_cases(strategies: list[str]) -> list[dict]:
    return [compose_case(s) for s in strategies]
