"""Models with op kinds the hook path of `hybridpar profile` does not know (tests/profile/test_graph_ops.py):
Conv3d, BatchNorm3d, MaxPool3d, LayerNorm, scaled-dot-product attention, GELU, an embedding."""

import torch
import torch.nn.functional as F
from torch import nn


class Net3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 8, 3, padding=1)
        self.bn = nn.BatchNorm3d(8)
        self.pool = nn.MaxPool3d(2)
        self.norm = nn.LayerNorm(8)
        self.qkv = nn.Linear(8, 24)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.pool(F.relu(self.bn(self.conv(x))))  # N, 8, 2, 4, 4
        t = self.norm(h.flatten(2).transpose(1, 2))  # N, 32 tokens, 8
        q, k, v = self.qkv(t).view(t.shape[0], t.shape[1], 2, 3, 4).permute(3, 0, 2, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(t.shape)
        return self.head(F.gelu(a + t).mean(1))


class TokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, ids):
        return self.head(F.gelu(self.norm(self.emb(ids))).mean(1))


def build():
    torch.manual_seed(0)
    return Net3d(), (torch.randn(4, 2, 4, 8, 8),)


def build_tokens():
    torch.manual_seed(0)
    return TokenNet(), (torch.randint(0, 50, (4, 12)),)
