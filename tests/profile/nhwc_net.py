"""A ConvNeXt-like CNN whose own forward hands its depthwise convolutions NHWC inputs (the permutes
around a LayerNorm over channels leave channels-last strides), for tests/profile/test_model_nhwc.py."""

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.pw1, self.pw2 = nn.Linear(c, 2 * c), nn.Linear(2 * c, c)

    def forward(self, x):
        h = self.dw(x).permute(0, 2, 3, 1)  # N, H, W, C
        h = self.pw2(F.gelu(self.pw1(self.norm(h))))
        return x + h.permute(0, 3, 1, 2)  # channels-last strides again


class Net(nn.Module):
    def __init__(self, c: int = 16, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 4, stride=4)
        self.norm = nn.LayerNorm(c)
        self.blocks = nn.Sequential(Block(c), Block(c))
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        h = self.norm(self.stem(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # HF ConvNeXt's channels_first norm
        return self.head(self.blocks(h).mean((2, 3)))


def build():
    torch.manual_seed(0)
    return Net(), (torch.randn(4, 3, 32, 32),)
