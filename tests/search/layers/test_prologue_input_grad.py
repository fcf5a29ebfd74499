"""The first layer after a prologue with parameters (an embedding before the first linear) computes
its input's gradient: the planner prices its backward-data collectives (the reduce-scatter of dx in
the filter group) as the runtime sends them, and predict_rank_memory groups layers by the same rule."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hybridpar.cli.main import main

MODEL = '''
import torch
from torch import nn


class EmbeddingMLP(nn.Module):
    """Token ids -> embedding (the prologue, with parameters) -> linear -> ReLU -> linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, ids):
        return self.fc2(torch.relu(self.fc1(self.emb(ids))))


def factory():
    return EmbeddingMLP(), (torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(0)),)
'''


def _graph(module, inputs):
    from hybridpar.graph import trace

    return trace(module, inputs)


def test_first_layer_after_an_embedding_needs_its_input_gradient():
    from hybridpar.cost.memory import layer_groups
    from hybridpar.search.layers.layer_graph import build_layer_graph

    ids = torch.randint(0, 50, (2, 8))
    emb = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    lg = build_layer_graph(_graph(emb, (ids,)))
    assert [n.op for n in lg.prefix] == ["embedding"]
    assert [v.input_grad for v in lg.vertices] == [True, True]
    assert [g for _, _, g in layer_groups(lg.graph)[0]] == [True, True]
    frozen = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 8))
    frozen[0].weight.requires_grad_(False)  # nothing upstream to train: no input gradient
    assert [v.input_grad for v in build_layer_graph(_graph(frozen, (ids,))).vertices] == [False]
    x = torch.randn(2, 16)  # the model's input alone: no input gradient either
    assert [v.input_grad for v in build_layer_graph(_graph(nn.Sequential(nn.Linear(16, 8)), (x,))).vertices] \
        == [False]


@pytest.mark.parametrize("strategy", ["filter=2", "channel=2,filter=2", "sample=2,filter=2"])
def test_planned_bytes_equal_the_runtimes_analytic_bytes(strategy, tmp_path):
    """Per kind, what the planner prices is what hybridpar.cost.layout_comm (the runtime's twin) counts."""
    from hybridpar.cost.layout_comm import bytes_by_kind, model_collectives
    from hybridpar.cost.scaling import graph_at_batch
    from hybridpar.plans import parse_strategy
    from hybridpar.search.layers.planner import _traced, plan_model

    path = tmp_path / "emb.py"
    path.write_text(MODEL)
    spec = f"{path}:factory"
    world = parse_strategy(strategy, 4).layout
    ranks = world.sample * world.channel * world.filter
    res = plan_model(spec, "localhost", ranks, 8, strategy=strategy)
    expected = bytes_by_kind(model_collectives(graph_at_batch(_traced(spec, None)[0], 8), world))
    assert {k: v for k, v in res.prediction.comm_bytes.items() if v} == expected
    assert expected["reduce_scatter"] > 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_planned_bytes_equal_the_bytes_train_sends_under_filter(tmp_path, monkeypatch, capsys):
    """`hybridpar plan --strategy filter=2` predicts, per collective kind, the bytes `hybridpar train`
    logs: the first linear's dx reduce-scatter included (before: 6,144 of 9,216 reduce-scatter bytes)."""
    monkeypatch.setenv("HYBRIDPAR_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "emb.py"
    path.write_text(MODEL)
    args = ["--model", f"{path}:factory", "--strategy", "filter=2", "--batch", "6", "--json"]
    assert main(["plan", *args, "--gpus", "2"]) == 0
    predicted = json.loads(capsys.readouterr().out)["predicted"]["comm_bytes"]
    assert main(["train", *args, "--nproc", "2", "--steps", "2"]) == 0
    sent = json.loads(capsys.readouterr().out)["steps"][-1]["comm_bytes"]
    assert {k: v for k, v in predicted.items() if v} == {k: v for k, v in sent.items() if v}
    assert sent["reduce_scatter"] == 4 * 6 * 8 * (32 + 16)  # fc2's dx and fc1's, 6 samples x 8 tokens
