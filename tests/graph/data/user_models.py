"""A user's own model file (not in the zoo), used by the `hybridpar inspect` tests."""

import torch
from torch import nn


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


def factory():
    return TinyNet()


def with_inputs():
    return TinyNet(), (torch.randn(4, 3, 32, 32),)


def broken():
    raise RuntimeError("out of coffee")


def not_a_module():
    return 42


class TokenNet(nn.Module):
    """Token ids -> embedding -> transformer encoder layer -> LSTM -> linear: every layer kind a
    language model brings, each with parameters (issue 13)."""

    def __init__(self, vocab: int = 100, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.enc = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.lstm = nn.LSTM(d, 24, batch_first=True)
        self.head = nn.Linear(24, vocab)

    def forward(self, ids):
        h, _ = self.lstm(self.enc(self.emb(ids)))
        return self.head(h)


def tokens():
    return TokenNet(), (torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(0)),)


class MaskedTokenNet(TokenNet):
    """Two inputs: token ids and a float mask that zeroes padded positions."""

    def forward(self, ids, mask):
        h, _ = self.lstm(self.enc(self.emb(ids)) * mask.unsqueeze(-1))
        return self.head(h)


def masked_tokens():
    ids = torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 12)
    mask[:, 9:] = 0
    return MaskedTokenNet(), (ids, mask)
