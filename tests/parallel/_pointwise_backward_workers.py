"""Rank functions for test_pointwise_backward_rules: a CNN whose activations' and average pooling's
backward ops torch 2.13 has no DTensor strategy for (ReLU6, Hardswish, Hardsigmoid, AvgPool2d), trained
through the public API against one process. Importable by module name, so they survive process spawn."""

from __future__ import annotations

import torch
from torch import nn

from ._global_workers import train_pair


class Activations(nn.Module):
    """Convs split on channels/filters with each activation between them, a pooling, a mean, a head."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 1)
        self.c = nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(8, 4)
        self.relu6, self.hswish, self.hsigmoid = nn.ReLU6(), nn.Hardswish(), nn.Hardsigmoid()
        self.pool = nn.AvgPool2d(2)

    def forward(self, x):
        h = self.relu6(3 * self.a(x))  # scaled so that some values exceed 6: both sides of the clamp
        h = self.hswish(self.b(h))
        h = self.pool(self.hsigmoid(self.c(h)))
        return self.head(h.mean((2, 3)))


def build():
    torch.manual_seed(0)
    return Activations(), torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))


def run(strategies: list[str]) -> list[dict]:
    return train_pair(build, strategies)
