"""BIG LSTM language model (Jozefowicz et al. 2016, 'Exploring the Limits of Language Modeling';
NVIDIA big-lstm): embedding 1024 -> 2-layer LSTM, 8192 units with a 1024 projection -> softmax over
the One Billion Word vocabulary (793,471 tokens, tensorflow/models research/lm_1b).

Parameters: 1,776,948,095 -- the paper's table gives 1.8 B (rounded; figures in
/work/shared/reference/convergence.yaml, lm1b model_facts). nn.LSTM keeps two bias vectors per layer
where TensorFlow's LSTMCell keeps one: 65,536 extra parameters in all (0.004%).
The softmax is modelled in full over the vocabulary by default (the cost the paper's 'full softmax'
evaluation pays). `num_sampled=S` models the *cost* of a sampled softmax with S classes (logits for
the first S rows only; an approximation: true-class logits are not added, parameters unchanged).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from hybridpar.graph.zoo.registry import register

VOCAB = 793_471
SEQ_LEN = 20


class BigLSTM(nn.Module):
    def __init__(self, vocab: int = VOCAB, embed: int = 1024, hidden: int = 8192, proj: int = 1024,
                 layers: int = 2, dropout: float = 0.1, num_sampled: int | None = None):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        # one nn.LSTM module per layer (lstm.0, lstm.1) so that model parallelism can put the layers on
        # different devices (Pal et al. 2019); same weights and FLOPs as nn.LSTM(num_layers=layers)
        self.lstm = nn.ModuleList(nn.LSTM(embed if i == 0 else proj, hidden, proj_size=proj, batch_first=True)
                                  for i in range(layers))
        self.dropout = nn.Dropout(dropout)
        self.softmax = nn.Linear(proj, vocab)
        self.num_sampled = num_sampled

    def forward(self, tokens):
        x = self.dropout(self.embedding(tokens))
        for lstm in self.lstm:  # dropout between layers, as nn.LSTM(dropout=...) applies it
            x, _ = lstm(x)
            x = self.dropout(x)
        if self.num_sampled:
            s = self.num_sampled
            return F.linear(x, self.softmax.weight[:s], self.softmax.bias[:s])
        return self.softmax(x)


@register("biglstm", kind="seq", input_shape=(SEQ_LEN,), num_classes=VOCAB, vocab=VOCAB,
          published_params=1_800_000_000,
          reference=("Jozefowicz et al. 2016 (arXiv:1602.02410), '2-Layer LSTM-8192-1024 (BIG LSTM)': 1.8 B "
                     "parameters, as rounded in the paper (tensorflow/models research/lm_1b README)"),
          description="BIG LSTM LM: 2x LSTM-8192 with 1024 projection, vocab 793,471, full softmax (T=20)")
def biglstm(num_sampled: int | None = None, vocab: int = VOCAB, layers: int = 2) -> nn.Module:
    return BigLSTM(vocab=vocab, layers=layers, num_sampled=num_sampled)
