"""A linear the runtime does not replace by a distributed layer (nn.MultiheadAttention's in_proj, an
F.linear call, and its out_proj, a NonDynamicallyQuantizableLinear: a subclass of nn.Linear) runs
whole on every rank: the cost model and the planner give it no channel/filter collectives and price
its compute whole (before: 2 x 3,072 allgather and reduce-scatter bytes too many under filter=2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.search.layers import tiny_encoder
from torch import nn

from hybridpar.cli.main import main

MODEL = Path(tiny_encoder.__file__).read_text()  # the model as a file, for --model file.py:factory


class MyLinear(nn.Linear):
    """A subclass keeps its own forward: the runtime leaves it replicated (styles.PARALLEL_STYLES)."""


def _traced(module, inputs):
    from hybridpar.graph import trace

    return trace(module, inputs)


def test_only_plain_linears_split_by_layout():
    from hybridpar.cost.layout_comm import layer_collectives, splits_by_layout
    from hybridpar.plans import LayerLayout

    enc = nn.Sequential(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0), MyLinear(16, 8),
                        nn.Linear(8, 4))
    g = _traced(enc, (torch.randn(8, 3, 16),))
    linears = [n for n in g.nodes if n.op == "linear"]
    # in_proj (F.linear), out_proj (a subclass, read functionally), linear1, linear2, MyLinear, Linear
    assert [splits_by_layout(n) for n in linears] == [False, False, True, True, False, True]
    lay = LayerLayout(sample=2, filter=2)
    for n in linears:
        ops = layer_collectives(n, lay)
        if splits_by_layout(n):
            assert {op.kind for op in ops} >= {"allgather", "reduce_scatter"}
        else:  # replicated: only its whole gradient, summed over the sample groups
            assert [(op.kind, op.group, op.bytes_) for op in ops] == [("allreduce", "replica", 4 * n.params)]


def test_a_whole_linear_is_priced_whole():
    from hybridpar.cluster import load_cluster
    from hybridpar.plans import LayerLayout
    from hybridpar.search.layers.layer_cost import CostContext, weight_layer_cost

    g = _traced(nn.Sequential(MyLinear(64, 64), nn.Linear(64, 64)), (torch.randn(32, 64),))
    mine, plain = [n for n in g.nodes if n.op == "linear"]
    ctx = CostContext(load_cluster("localhost", gpus=4), batch=32, ranks=4)
    whole, split = LayerLayout(), LayerLayout(filter=4)
    assert weight_layer_cost(mine, (), split, ctx).fwd_s == pytest.approx(weight_layer_cost(mine, (), whole, ctx).fwd_s)
    assert weight_layer_cost(mine, (), split, ctx).comm_bytes == {}
    assert weight_layer_cost(mine, (), split, ctx).memory_bytes == weight_layer_cost(mine, (), whole, ctx).memory_bytes
    assert weight_layer_cost(plain, (), split, ctx).fwd_s < weight_layer_cost(plain, (), whole, ctx).fwd_s
    assert weight_layer_cost(plain, (), split, ctx).comm_bytes
    # predict_rank_memory (what `plan --strategy` states) holds it whole too
    from hybridpar.cost.memory import predict_rank_memory

    alone = _traced(nn.Sequential(MyLinear(64, 64)), (torch.randn(32, 64),))
    assert predict_rank_memory(alone, "filter=4", batch=32, framework_bytes=0).total_bytes == \
        predict_rank_memory(alone, whole, batch=32, framework_bytes=0).total_bytes


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_planned_bytes_equal_the_bytes_train_sends(tmp_path, monkeypatch, capsys):
    """`hybridpar plan --strategy filter=2` predicts, per kind, the bytes `hybridpar train` logs for
    a model whose attention projections stay replicated (before: 26,496 / 18,432 predicted against
    20,352 / 12,288 allgather / reduce-scatter bytes sent)."""
    monkeypatch.setenv("HYBRIDPAR_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "enc.py"
    path.write_text(MODEL)
    args = ["--model", f"{path}:factory", "--strategy", "filter=2", "--batch", "6", "--json"]
    assert main(["plan", *args, "--gpus", "2"]) == 0
    planned = json.loads(capsys.readouterr().out)
    predicted = planned["predicted"]["comm_bytes"]
    layouts = {p["node"]: p["layout"] for p in planned["parameters"] if p["op"] == "linear"}
    assert layouts == {"linear": "whole", "linear_1": "whole", "linear_2": "filter=2", "linear_3": "filter=2",
                       "linear_4": "filter=2"}  # the gradient listing says which stay replicated
    assert main(["train", *args, "--nproc", "2", "--steps", "2"]) == 0
    sent = json.loads(capsys.readouterr().out)["steps"][-1]["comm_bytes"]
    assert {k: v for k, v in predicted.items() if v} == {k: v for k, v in sent.items() if v}
    # linear1, linear2 and head: dx reduce-scattered over 6 samples x 8 tokens (16 + 32 + 16 features)
    assert sent["reduce_scatter"] == 4 * 6 * 8 * (16 + 32 + 16)
