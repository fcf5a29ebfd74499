"""The recurrent model of bench_mp.py's wavefront row: token ids [N, T] -> nn.Embedding -> one
nn.LSTM(num_layers=4) -> nn.Linear over the last step's state [N, 10]. With `--time-chunks K` the MP
runtime splits the stacked module per layer and each layer's sequence into K chunks
(parallel/pipeline/wavefront.py); without, the module runs whole on one device."""

from __future__ import annotations

import os

import torch
from torch import nn

# HYBRIDPAR_BENCH_LSTM4 = "hidden,steps" (the quick mode's smaller model); default 192 units, 32 steps
HIDDEN, STEPS = (int(v) for v in os.environ.get("HYBRIDPAR_BENCH_LSTM4", "192,32").split(","))


class LSTM4(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = HIDDEN, layers: int = 4, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens):
        h, _ = self.lstm(self.embed(tokens))
        return self.head(h[:, -1])


def lstm4():
    torch.manual_seed(0)
    return LSTM4(), (torch.randint(0, 64, (2, STEPS)),)
