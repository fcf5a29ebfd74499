import torch
from torch import nn


class BatchCentered(nn.Module):
    """Centres features on the batch mean inside forward: exact in one process, not per-sample."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h - h.mean(0, keepdim=True))


class PerSample(BatchCentered):
    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h - h.mean(1, keepdim=True))


def mixing():
    return BatchCentered(), torch.randn(4, 8)


def independent():
    return PerSample(), torch.randn(4, 8)
