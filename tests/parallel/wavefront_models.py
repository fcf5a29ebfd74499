"""Recurrent models for the time-chunk wavefront tests (tests/parallel/test_mp_wavefront.py): a 4-layer
LSTM language model written here (one stacked nn.LSTM, dict output) and the zoo's GNMT at a tiny size,
with `hybridpar train` factories (module, example inputs)."""

from __future__ import annotations

import torch
from torch import nn

from hybridpar.graph.zoo.gnmt import gnmt

VOCAB, HIDDEN, STEPS = 32, 12, 8


class LSTMLM(nn.Module):
    """Token ids [N, T] -> {"logits": [N, T, V], "hidden": [N, T, H]}: nn.Embedding, one nn.LSTM with
    num_layers=4 (split per layer by the runtime), nn.Linear."""

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        h, _ = self.lstm(self.embed(tokens))
        return {"logits": self.head(h), "hidden": h}


class LSTMLMLogits(LSTMLM):
    """LSTMLM with one output (for `hybridpar train`, whose loss takes the logits)."""

    def forward(self, tokens):
        return super().forward(tokens)["logits"]


def tiny_gnmt() -> nn.Module:
    """The zoo's GNMT v2 (bidirectional first encoder layer, residual stacks, attention) at a tiny size."""
    return gnmt(num_layers=4, hidden=HIDDEN, vocab=VOCAB, dropout=0.0)


def tokens(batch: int, g: torch.Generator | None = None) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, STEPS), generator=g)


def lm_logits():
    """`hybridpar train` factory: the LM (logits only) and an example batch."""
    return LSTMLMLogits(), (tokens(2),)


def gnmt_tiny():
    """`hybridpar train` factory: tiny GNMT and an example (source, target) batch."""
    return tiny_gnmt(), (tokens(2), tokens(2))
