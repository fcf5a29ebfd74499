"""A model a channel/filter layout cannot serve (a data-dependent shape in forward), shared by the CLI
refusal test (as a model file) and the API check test."""

import torch
from torch import nn


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        h = self.conv(x)
        distinct = torch.unique(h.argmax(1)).numel()  # a data-dependent shape: no DTensor rule
        return self.head(h.mean((2, 3))) * distinct


def net():
    return Counting()
