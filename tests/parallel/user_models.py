"""Models written the way users write them (not for the zoo): forwards that read shapes, mix
channels between layers, or come from other libraries. Each factory returns (module, x, y)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ShapeReader(nn.Module):
    """Checks the input's channel count and reshapes with sizes it reads, as library models do."""

    def __init__(self, c: int = 3, k: int = 10):
        super().__init__()
        self.c = c
        self.conv1 = nn.Conv2d(c, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 6, 3, padding=1)
        self.fc = nn.Linear(6 * 4 * 4, k)

    def forward(self, x):
        if x.shape[1] != self.c:
            raise ValueError(f"expected {self.c} channels, got {x.size(1)}")
        h = F.relu(self.bn(self.conv1(x)))
        h = F.max_pool2d(self.conv2(h), 2)
        n, c, hh, ww = h.shape
        return self.fc(h.reshape(n, c * hh * ww))


class ChannelSoftmax(nn.Module):
    def __init__(self, k: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, k)

    def forward(self, x):
        h = torch.softmax(self.conv1(x), dim=1)
        h = F.relu(self.conv2(h))
        return self.fc(h.mean((2, 3)))


class SqueezeExcite(nn.Module):
    def __init__(self, k: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.se1 = nn.Linear(8, 4)
        self.se2 = nn.Linear(4, 8)
        self.head = nn.Conv2d(8, 6, 1)
        self.fc = nn.Linear(6, k)

    def forward(self, x):
        h = F.relu(self.conv(x))
        s = torch.sigmoid(self.se2(F.relu(self.se1(h.mean((2, 3))))))
        h = h * s[:, :, None, None]
        return self.fc(self.head(h).flatten(2).mean(-1))


class MeanGate(nn.Module):
    def __init__(self, k: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, k)

    def forward(self, x):
        h = self.conv1(x)
        h = h * torch.sigmoid(h.mean(1, keepdim=True))
        h = F.adaptive_avg_pool2d(F.relu(self.conv2(h)), 4)
        return self.fc(torch.flatten(h, 1))


class LRNNet(nn.Module):
    def __init__(self, k: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.lrn = nn.LocalResponseNorm(3)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, k)

    def forward(self, x):
        h = self.lrn(F.relu(self.conv1(x)))
        return self.fc(F.relu(self.conv2(h)).mean((2, 3)))


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7, permute to channels-last, LayerNorm, MLP, layer scale, permute back."""

    def __init__(self, dim: int = 8, k: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 2, stride=2)
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))
        self.fc = nn.Linear(dim, k)

    def forward(self, x):
        x = self.stem(x)
        h = self.dwconv(x).permute(0, 2, 3, 1)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        x = x + (self.gamma * h).permute(0, 3, 1, 2)
        return self.fc(x.mean((-2, -1)))


USER_MODELS = {"shape_reader": ShapeReader, "channel_softmax": ChannelSoftmax, "squeeze_excite": SqueezeExcite,
               "mean_gate": MeanGate, "lrn": LRNNet, "convnext_block": ConvNeXtBlock}


def build(name: str, seed: int = 0, n: int = 8):
    torch.manual_seed(seed)
    m = USER_MODELS[name]()
    x = torch.randn(n, 3, 8, 8)
    y = torch.randint(0, 10, (n,))
    return m, x, y
