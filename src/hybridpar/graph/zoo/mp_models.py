"""Small models for the model-parallel runtime on CPU: a branchy Inception-style network and a
2-layer LSTM classifier. Both are our own definitions (no published size); each LSTM layer is its
own module so a placement can put the layers on different devices, as Pal et al. do for GNMT and
BigLSTM."""

from __future__ import annotations

import torch
from torch import nn

from hybridpar.graph.zoo.registry import register


def _conv_relu(cin: int, cout: int, k: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, k, padding=k // 2), nn.ReLU()]


class InceptionBlock(nn.Module):
    """GoogLeNet's Inception module (Szegedy et al. 2015, without batch norm): 1x1, 1x1->3x3,
    1x1->5x5 and 3x3 max-pool->1x1 branches concatenated on channels."""

    def __init__(self, cin: int, c1: int, c3r: int, c3: int, c5r: int, c5: int, cp: int):
        super().__init__()
        self.b1 = nn.Sequential(*_conv_relu(cin, c1, 1))
        self.b3 = nn.Sequential(*_conv_relu(cin, c3r, 1), *_conv_relu(c3r, c3, 3))
        self.b5 = nn.Sequential(*_conv_relu(cin, c5r, 1), *_conv_relu(c5r, c5, 5))
        self.bp = nn.Sequential(nn.MaxPool2d(3, 1, 1), *_conv_relu(cin, cp, 1))
        self.out_channels = c1 + c3 + c5 + cp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], dim=1)


class InceptionMini(nn.Module):
    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 8):
        super().__init__()
        w = width
        self.stem = nn.Sequential(*_conv_relu(in_channels, 2 * w, 3))
        self.block1 = InceptionBlock(2 * w, w, w, w, w // 2, w, w)
        self.pool = nn.MaxPool2d(2)
        c = self.block1.out_channels
        self.block2 = InceptionBlock(c, w, w, 2 * w, w // 2, w, w)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(self.block2.out_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.block1(self.stem(x)))
        return self.fc(self.flatten(self.gap(self.block2(x))))


@register("inception_mini", kind="cnn", input_shape=(3, 32, 32), num_classes=10,
          description="stem + 2 Inception blocks (1x1/3x3/5x5/pool branches) + FC, for MP tests on CPU",
          reference="hybridpar's own test model (Inception module of Szegedy et al. 2015, no BN)")
def inception_mini(in_channels: int = 3, num_classes: int = 10, width: int = 8) -> nn.Module:
    return InceptionMini(in_channels, num_classes, width)


class LSTM2(nn.Module):
    """Embedding -> LSTM -> LSTM -> linear classifier on the last time step."""

    def __init__(self, vocab: int = 64, embed: int = 32, hidden: int = 64, num_classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm1 = nn.LSTM(embed, hidden, batch_first=True)
        self.lstm2 = nn.LSTM(hidden, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm1(self.embed(tokens))
        h, _ = self.lstm2(h)
        return self.fc(h[:, -1])


@register("lstm2", kind="seq", input_shape=(16,), num_classes=10, vocab=64,
          description="embedding + 2 single-layer LSTMs + FC classifier, for MP tests on CPU",
          reference="hybridpar's own test model (2-layer LSTM as in BigLSTM/GNMT, tiny)")
def lstm2(vocab: int = 64, embed: int = 32, hidden: int = 64, num_classes: int = 10) -> nn.Module:
    return LSTM2(vocab, embed, hidden, num_classes)
