"""GNMT v2 (NVIDIA DeepLearningExamples PyTorch/Translation/GNMT, default configuration) in plain PyTorch.

Encoder: shared embedding -> bidirectional LSTM -> LSTM(2h->h) -> LSTMs with residual connections.
Decoder (gnmt_v2 attention): LSTM -> normalised Bahdanau attention over the encoder output; every later
LSTM takes [x, context] and, from the second on, adds a residual; classifier over the vocabulary.
Embedding shared between encoder and decoder. With hidden 1024, 4+4 layers and vocab 32,320 this has
exactly NVIDIA's 160,671,297 parameters (MLPerf v0.7 NVIDIA log 'Number of parameters: 160671297';
reference figures in /work/shared/reference/convergence.yaml, gnmt model_facts).
Inputs are token ids (batch, T) for source and target, batch-first (NVIDIA runs time-major; the
arithmetic is the same). Packed variable-length sequences are not modelled: every sentence has T tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.graph.zoo.registry import register

VOCAB = 32_320
SEQ_LEN = 50


class BahdanauAttention(nn.Module):
    """Normalised Bahdanau attention (NVIDIA's `BahdanauAttention(normalize=True)`)."""

    def __init__(self, query_size: int, key_size: int, num_units: int):
        super().__init__()
        self.linear_q = nn.Linear(query_size, num_units, bias=False)
        self.linear_k = nn.Linear(key_size, num_units, bias=False)
        self.linear_att = nn.Parameter(torch.empty(num_units).uniform_(-0.1, 0.1))
        self.normalize_scalar = nn.Parameter(torch.full((1,), 1.0 / num_units ** 0.5))
        self.normalize_bias = nn.Parameter(torch.zeros(num_units))

    def forward(self, query, keys):
        # query (b, t_q, q), keys (b, t_k, k) -> context (b, t_q, k)
        sum_qk = self.linear_q(query).unsqueeze(2) + self.linear_k(keys).unsqueeze(1) + self.normalize_bias
        att = self.linear_att / self.linear_att.norm() * self.normalize_scalar
        scores = F.linear(torch.tanh(sum_qk), att.unsqueeze(0)).squeeze(-1)
        return torch.bmm(F.softmax(scores, dim=-1), keys)


class Encoder(nn.Module):
    def __init__(self, embedder: nn.Embedding, hidden: int, layers: int, dropout: float):
        super().__init__()
        self.embedder = embedder
        rnns = [nn.LSTM(hidden, hidden, batch_first=True, bidirectional=True),
                nn.LSTM(2 * hidden, hidden, batch_first=True)]
        rnns += [nn.LSTM(hidden, hidden, batch_first=True) for _ in range(layers - 2)]
        self.rnn_layers = nn.ModuleList(rnns)
        self.dropout = nn.Dropout(dropout)

    def forward(self, src):
        x = self.embedder(src)
        x, _ = self.rnn_layers[0](self.dropout(x))
        x, _ = self.rnn_layers[1](self.dropout(x))
        for rnn in self.rnn_layers[2:]:
            y, _ = rnn(self.dropout(x))
            x = x + y
        return x


class Decoder(nn.Module):
    def __init__(self, embedder: nn.Embedding, vocab: int, hidden: int, layers: int, dropout: float):
        super().__init__()
        self.embedder = embedder
        self.att_rnn = nn.LSTM(hidden, hidden, batch_first=True)
        self.attn = BahdanauAttention(hidden, hidden, hidden)
        self.rnn_layers = nn.ModuleList(nn.LSTM(2 * hidden, hidden, batch_first=True) for _ in range(layers - 1))
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden, vocab)

    def forward(self, tgt, context):
        x, _ = self.att_rnn(self.embedder(tgt))
        x = self.dropout(x)
        ctx = self.attn(x, context)
        x, _ = self.rnn_layers[0](torch.cat((x, ctx), 2))
        for rnn in self.rnn_layers[1:]:
            y, _ = rnn(torch.cat((self.dropout(x), ctx), 2))
            x = x + y
        return self.classifier(x)


class GNMT(nn.Module):
    def __init__(self, vocab: int = VOCAB, hidden: int = 1024, num_layers: int = 4, dropout: float = 0.2):
        super().__init__()
        if num_layers < 2:
            raise ValueError("GNMT needs at least 2 layers per side")
        embedder = nn.Embedding(vocab, hidden)
        self.encoder = Encoder(embedder, hidden, num_layers, dropout)
        self.decoder = Decoder(embedder, vocab, hidden, num_layers, dropout)

    def forward(self, src, tgt):
        return self.decoder(tgt, self.encoder(src))


def _token_pair(batch: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    # Ids below 32 stay valid when a smaller vocabulary is passed as an override.
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 32, (batch, *shape), generator=g), torch.randint(0, 32, (batch, *shape), generator=g))


_REF = ("NVIDIA DeepLearningExamples PyTorch/Translation/GNMT (default config); 160,671,297 parameters "
        "per the MLPerf v0.7 NVIDIA GNMT log")


@register("gnmt", kind="seq", input_shape=(SEQ_LEN,), num_classes=VOCAB, vocab=VOCAB, make_inputs=_token_pair,
          published_params=160_671_297, reference=_REF,
          description="GNMT v2: 4+4 LSTM layers (hidden 1024), attention, vocab 32,320 (src and tgt T=50)")
def gnmt(num_layers: int = 4, hidden: int = 1024, vocab: int = VOCAB, dropout: float = 0.2) -> nn.Module:
    return GNMT(vocab, hidden, num_layers, dropout)


@register("gnmt8", kind="seq", input_shape=(SEQ_LEN,), num_classes=VOCAB, vocab=VOCAB, make_inputs=_token_pair,
          reference=_REF + "; 8+8 layers as in Wu et al. 2016 (GNMT paper). No published count: ours.",
          description="GNMT v2 with 8 encoder + 8 decoder LSTM layers (hidden 1024, vocab 32,320)")
def gnmt8(hidden: int = 1024, vocab: int = VOCAB, dropout: float = 0.2) -> nn.Module:
    return GNMT(vocab, hidden, 8, dropout)
