"""Models not in the zoo, for model parallelism in the user's own loop (tests/parallel/test_mp_own_loop.py)
and `hybridpar train --model tests/parallel/mp_user_models.py:<factory>`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BranchyCNN(nn.Module):
    """Two branches that join (add and concatenate), batch norm, a channel gate: a DAG, not a chain."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.left = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1))
        self.right = nn.Sequential(nn.Conv2d(8, 8, 1), nn.Tanh())
        self.mix = nn.Conv2d(16, 12, 3, stride=2, padding=1)
        self.gate = nn.Linear(12, 12)
        self.head = nn.Linear(12, classes)

    def forward(self, x):
        h = F.relu(self.bn(self.stem(x)))
        a, b = self.left(h), self.right(h)
        h = F.relu(self.mix(torch.cat([a + b, a * b], dim=1)))
        pooled = h.mean((2, 3))
        return self.head(pooled * torch.sigmoid(self.gate(pooled)))


class TwoInput(nn.Module):
    """An image and a vector per sample; returns (logits, aux) as a tuple."""

    def __init__(self, classes: int = 5, features: int = 6):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.vec = nn.Sequential(nn.Linear(features, 16), nn.ReLU())
        self.head = nn.Linear(8 + 16, classes)
        self.aux = nn.Linear(16, 1)

    def forward(self, image, vector):
        h = F.relu(self.conv2(F.relu(self.conv(image)))).mean((2, 3))
        v = self.vec(vector)
        return self.head(torch.cat([h, v], dim=1)), self.aux(v)


class TwoInputLogits(TwoInput):
    """TwoInput with one output (for `hybridpar train`, whose loss takes the logits)."""

    def forward(self, image, vector):
        return super().forward(image, vector)[0]


class StackedLSTMLM(nn.Module):
    """Token ids [N, T] -> {"logits": [N, T, V], "hidden": [N, T, H]}: two stacked LSTM layers."""

    def __init__(self, vocab: int = 32, hidden: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm1 = nn.LSTM(hidden, hidden, batch_first=True)
        self.lstm2 = nn.LSTM(hidden, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        h, _ = self.lstm1(self.embed(tokens))
        h2, _ = self.lstm2(h)
        return {"logits": self.fc(h2 + h), "hidden": h2}


class BN1dNet(nn.Module):
    """Batch norm on [N, C] and [N, C, L] (BatchNorm1d both ways) between linear layers."""

    def __init__(self, features: int = 6, classes: int = 5):
        super().__init__()
        self.fc1 = nn.Linear(features, 12)
        self.bn1 = nn.BatchNorm1d(12)
        self.conv = nn.Conv1d(1, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm1d(4)
        self.fc2 = nn.Linear(4 * 12, classes)

    def forward(self, x):
        h = F.relu(self.bn1(self.fc1(x)))
        h = F.relu(self.bn2(self.conv(h.unsqueeze(1))))
        return self.fc2(h.flatten(1))


class MyBatchNorm3d(nn.BatchNorm3d):
    """A user's subclass of a batch norm (defined outside torch.nn: torch.fx would trace into it)."""


class BN3dNet(nn.Module):
    """Volumes [N, 2, D, H, W]: Conv3d + BatchNorm3d, and a subclass of BatchNorm3d."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.conv1 = nn.Conv3d(2, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm3d(4)
        self.conv2 = nn.Conv3d(4, 6, 3, padding=1)
        self.bn2 = MyBatchNorm3d(6)
        self.fc = nn.Linear(6, classes)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return self.fc(h.mean((2, 3, 4)))


def two_input():
    """`hybridpar train` factory: (module, example inputs) of a two-input model."""
    return TwoInputLogits(), (torch.randn(2, 3, 8, 8), torch.randn(2, 6))


def branchy():
    """`hybridpar train` factory taking --input-shape."""
    return BranchyCNN()
