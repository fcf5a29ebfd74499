"""Memory of the layers before the first conv/linear (an embedding, recurrent layers over it) and of
recurrent and attention layers anywhere: `predict_rank_memory` (and so `hybridpar plan`) counts their
parameters, gradients and optimizer state, and the activations autograd keeps for them, including
the state a recurrent layer or attention keeps inside. Before, a token model's embedding and LSTM
were in no layer and counted nothing."""

from __future__ import annotations

import pytest
import torch
from autograd_saved import saved_bytes
from torch import nn

from hybridpar.cost.memory import predict_rank_memory, training_memory
from hybridpar.graph.tracing import trace

BATCH, STEPS, VOCAB, EMBED, HIDDEN = 8, 12, 32, 16, 32


class TokenLSTM(nn.Module):
    def __init__(self, cell=nn.LSTM):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)
        self.rnn = cell(EMBED, HIDDEN, batch_first=True)
        self.fc = nn.Linear(HIDDEN, 4)

    def forward(self, tokens):
        h, _ = self.rnn(self.embed(tokens))
        return self.fc(h[:, -1])


class TokenEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)
        # dropout 0.1 (the default): torch's CPU attention takes its math path, every dropout keeps its noise
        self.layer = nn.TransformerEncoderLayer(EMBED, 4, 2 * EMBED, batch_first=True)
        self.fc = nn.Linear(EMBED, 4)

    def forward(self, tokens):
        return self.fc(self.layer(self.embed(tokens))[:, -1])


def _model(make):
    torch.manual_seed(0)
    return make(), (torch.randint(0, VOCAB, (BATCH, STEPS)),)  # modules start in training mode


@pytest.mark.parametrize("make", [TokenLSTM, lambda: TokenLSTM(nn.GRU), TokenEncoder, lambda: TokenEncoder().eval()],
                         ids=["lstm", "gru", "encoder", "encoder-eval"])  # eval: no dropout, flash attention
def test_every_parameter_and_kept_activation_counted(make):
    model, inputs = _model(make)
    g = trace(model, inputs)
    pred = predict_rank_memory(g, "sample=1", batch=BATCH, framework_bytes=0)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert pred.weights_bytes == pred.grads_bytes == nbytes  # the embedding's and the LSTM's too
    real = saved_bytes(model, inputs)
    assert pred.activations_bytes == pytest.approx(real, rel=0.1)  # oneDNN's LSTM workspace: a fit
    # the placer's whole-graph count: the same rule (plus the graph input, in io_bytes per layer)
    whole = training_memory(g, optimizer="sgd")
    assert whole.params_bytes == nbytes
    assert whole.activations_bytes == pred.activations_bytes + 4 * inputs[0].numel()


@pytest.mark.parametrize("strategy,gpus", [("sample=2", 2), ("channel=2", 2)])
def test_planner_states_the_same_memory_and_lists_the_prologue(strategy, gpus):
    """`hybridpar plan --strategy S` states predict_rank_memory's figure for a token model (planned at
    twice the batch it was traced at), and its per-layer rows give the embedding and the LSTM their
    memory (they were listed with 0 bytes)."""
    from hybridpar.search.layers.planner import plan_model

    model, inputs = _model(TokenLSTM)
    res = plan_model((model, inputs), "localhost", gpus, 2 * BATCH, strategy=strategy,
                     runnable_only=False)  # channel=2 with an LSTM: a what-if the runtime cannot run
    g = trace(model, inputs)
    assert res.plan.predicted.memory_bytes[0] == int(predict_rank_memory(g, strategy, batch=2 * BATCH).total_bytes)
    rows = res.prediction.per_layer
    whole = {name: sum(p.numel() for p in mod.parameters()) * 4 for name, mod in model.named_children()}
    for name in ("embed", "rnn"):  # whole on every rank: weights and gradients at least
        assert rows[name]["memory_bytes"] >= 2 * whole[name]
