"""Models whose 4-D activations leave the channels-last format (tests/profile/test_channels_last_pricing.py):
a CNN whose classifier flattens an 8 x 8 activation (no global pooling, as VGG/AlexNet do), and a
patch-embedding transformer, whose attention heads are 4-D tensors that are not images."""

import torch
import torch.nn.functional as F
from torch import nn


def build() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


class PatchNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, 8, 4, stride=4)  # 16 x 16 -> 4 x 4 patches
        self.qkv = nn.Linear(8, 24)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        t = self.embed(x).flatten(2).transpose(1, 2)  # N, 16 tokens, 8
        q, k, v = self.qkv(t).view(t.shape[0], t.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)  # N, 2 heads, 16, 4
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(t.shape)
        return self.head((a + t).mean(1))


def build_patch() -> nn.Module:
    torch.manual_seed(0)
    return PatchNet()


class ViewNet(nn.Module):
    """The flatten written as a view, which the tracer folds into the Linear after it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        return self.fc(y.view(y.shape[0], -1))


def build_view() -> nn.Module:
    torch.manual_seed(0)
    return ViewNet()
