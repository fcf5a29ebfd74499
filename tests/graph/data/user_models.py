"""A user's own model file (not in the zoo), used by the `hybridpar inspect` tests."""

import torch
from torch import nn


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


def factory():
    return TinyNet()


def with_inputs():
    return TinyNet(), (torch.randn(4, 3, 32, 32),)


def broken():
    raise RuntimeError("out of coffee")


def not_a_module():
    return 42
