"""A small token model for the planner's byte tests: embedding -> TransformerEncoderLayer -> head.
Also written to a file as it stands (`hybridpar plan --model file.py:factory`)."""

import torch
from torch import nn


class TinyEncoder(nn.Module):
    """Token ids -> embedding -> transformer encoder layer -> linear head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0)
        self.head = nn.Linear(16, 10)

    def forward(self, ids):
        return self.head(self.enc(self.emb(ids)))


def factory(batch: int = 4):
    return TinyEncoder(), (torch.randint(0, 50, (batch, 8), generator=torch.Generator().manual_seed(0)),)
