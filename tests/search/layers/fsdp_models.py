"""Small CNNs for the FSDP/recomputation planner tests (not in the zoo)."""

from __future__ import annotations

import torch
from torch import nn


class BlockCNN(nn.Module):
    """A stem, `depth` conv-BN-ReLU blocks of `width` channels (a ModuleList: the runtime's FSDP and
    recomputation blocks), global average pooling and a linear head."""

    def __init__(self, width: int = 64, depth: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width),
                                                  nn.ReLU()) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


def wide_cnn():
    """Weights dominate (512 channels on 8x8 images): channel/filter splits them."""
    torch.manual_seed(0)
    return BlockCNN(512, 3), (torch.randn(1, 3, 8, 8),)


def activation_heavy_cnn():
    """Activations dominate (64 channels on 64x64 images, 8 blocks): recomputation frees them, and
    channel/filter, which gathers each conv's input, needs more than data parallelism."""
    torch.manual_seed(0)
    return BlockCNN(64, 8), (torch.randn(1, 3, 64, 64),)
