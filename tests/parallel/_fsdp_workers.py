"""Rank function and model for tests/parallel/test_fsdp.py (importable by spawned ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hybridpar


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class SmallNet(nn.Module):
    """Conv + batch norm blocks and a linear head (5 outputs: an uneven shard over 2 ranks)."""

    def __init__(self):
        super().__init__()
        self.stem = ConvBlock(3, 6)
        self.body = nn.ModuleList([ConvBlock(6, 6), ConvBlock(6, 4)])
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        x = self.stem(x)
        for b in self.body:
            x = b(x)
        return self.head(x.mean((2, 3)))


def make_model() -> SmallNet:
    torch.manual_seed(0)
    return SmallNet().double()


def make_opt(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def data(steps: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 5, (8,), generator=g))
            for _ in range(steps)]


def train(model: nn.Module, opt_name: str, steps: int = 3, accumulate: bool = False) -> list[float]:
    """Steps of mean cross-entropy over the global batch; `accumulate`: each step as two half-batches,
    the first under hybridpar.no_sync (a one-process model sums them the same way)."""
    opt = make_opt(opt_name, model.parameters())
    losses = []
    for x, y in data(steps):
        opt.zero_grad()
        if accumulate and hasattr(model, "hybridpar"):
            with hybridpar.no_sync(model):
                (F.cross_entropy(model(x[:4]), y[:4]) / 2).backward()
            loss = F.cross_entropy(model(x[4:]), y[4:]) / 2
        elif accumulate:
            (F.cross_entropy(model(x[:4]), y[:4]) / 2).backward()
            loss = F.cross_entropy(model(x[4:]), y[4:]) / 2
        else:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


CASES = [("sample=2,zero=3", "none", "sgd", False), ("sample=2,zero=3", "none", "adamw", False),
         ("sample=2,zero=2", "none", "sgd", False), ("sample=2,zero=2", "none", "adamw", False),
         ("sample=2", "all", "sgd", False), ("sample=2", "all", "adamw", False),
         ("sample=2,zero=3", "all", "sgd", False), ("sample=2,zero=3", "all", "adamw", False),
         ("sample=2,zero=3", "none", "sgd", True)]


def run_cases(cases=CASES) -> dict:
    """Every case on this world; rank 0's full_state_dict, losses, local parameter sizes and how often
    the stem's convolution ran per step (2 with recomputation)."""
    out = {}
    for strategy, recompute, opt_name, acc in cases:
        model = make_model()
        calls = [0]
        model.stem.conv.register_forward_hook(lambda *_, c=calls: c.__setitem__(0, c[0] + 1))
        hybridpar.parallelize(model, strategy, recompute=recompute)
        losses = train(model, opt_name, accumulate=acc)
        full = hybridpar.full_state_dict(model)
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
        out[(strategy, recompute, opt_name, acc)] = {"state": full, "losses": losses, "local_numel": local,
                                                     "conv_calls": calls[0], "rank": dist.get_rank()}
    return out


def small_net() -> SmallNet:
    """`hybridpar train --model tests/parallel/_fsdp_workers.py:small_net --input-shape 3,6,6`."""
    return SmallNet()
