"""Time-major tensors (inside nn.MultiheadAttention always, nn.LSTM without batch_first) are priced at
the batch asked for: a graph traced at batch B and planned at 4B costs what a trace at 4B costs (time,
bytes and memory per layer), by one rule (hybridpar.cost.scaling.shape_at_batch) for the planner's
time and hybridpar.cost.memory's activations."""

from __future__ import annotations

from functools import cache

import pytest
import torch
from torch import nn

from hybridpar.cost.scaling import shape_at_batch

B = 2


class TimeMajor(nn.Module):
    """(N, T, E) in; self-attention without batch_first, a residual, layer norm and an LSTM over
    (T, N, E) inside; a head on (N, T, E)."""

    def __init__(self, e: int = 128):
        super().__init__()
        self.inp = nn.Linear(e, e)
        self.attn = nn.MultiheadAttention(e, 4)
        self.norm = nn.LayerNorm(e)
        self.lstm = nn.LSTM(e, e)
        self.head = nn.Linear(e, 10)

    def forward(self, x):
        h = self.inp(x).transpose(0, 1)
        a, _ = self.attn(h, h, h, need_weights=False)
        r, _ = self.lstm(self.norm(torch.relu(a + h)))
        return self.head(r.transpose(0, 1))


@cache
def _traced(batch: int):
    from hybridpar.graph import trace

    torch.manual_seed(0)
    return trace(TimeMajor(), (torch.randn(batch, 32, 128),))


def test_shape_at_batch_finds_the_batch_dimension():
    assert shape_at_batch((2, 64, 256), 8, 2) == (8, 64, 256)  # batch-major
    assert shape_at_batch((64, 2, 256), 8, 2) == (64, 8, 256)  # (steps, batch, features)
    assert shape_at_batch((128, 256), 8, 2) == (512, 256)  # (steps x batch, features)
    assert shape_at_batch((), 8, 2) == ()


def test_every_node_traced_at_b_has_the_shapes_of_a_trace_at_4b():
    from hybridpar.cost.scaling import graph_at_batch

    small, big = graph_at_batch(_traced(B), 4 * B), _traced(4 * B)
    assert [(n.in_shapes, n.out_shape) for n in small.nodes] == [(n.in_shapes, n.out_shape) for n in big.nodes]
    assert any(n.op == "linear" and n.in_shapes[0][1] == 4 * B for n in big.nodes)  # time-major ones among them


@pytest.mark.parametrize("strategy", ["sample=1", "filter=2", "sample=2"])
def test_planned_at_4b_costs_what_a_trace_at_4b_costs(strategy):
    from hybridpar.cost.memory import predict_rank_memory
    from hybridpar.search.layers.planner import plan_model

    gpus = 1 if strategy == "sample=1" else 2
    # runnable_only=False: filter=2 with an LSTM is a what-if (the runtime cannot run it); its pricing is the test
    scaled, direct = (plan_model(_traced(b), "lassen", gpus, 4 * B, strategy=strategy, runnable_only=False)
                      for b in (B, 4 * B))
    assert [lc.name for lc in scaled.layers] == [lc.name for lc in direct.layers]
    def per_layer(res, what):
        return {lc.name: what(lc.cost) for lc in res.layers}

    compute = per_layer(direct, lambda c: c.fwd_s + c.bwd_s)
    assert per_layer(scaled, lambda c: c.fwd_s + c.bwd_s) == pytest.approx(compute, rel=1e-9)
    assert per_layer(scaled, lambda c: c.comm_bytes) == per_layer(direct, lambda c: c.comm_bytes)
    assert per_layer(scaled, lambda c: c.memory_bytes) == pytest.approx(per_layer(direct, lambda c: c.memory_bytes),
                                                                         rel=1e-9)
    assert scaled.prediction.step_time_s == pytest.approx(direct.prediction.step_time_s, rel=1e-9)
    assert predict_rank_memory(_traced(B), strategy, batch=4 * B, framework_bytes=0).total_bytes == pytest.approx(
        predict_rank_memory(_traced(4 * B), strategy, batch=4 * B, framework_bytes=0).total_bytes, rel=1e-9)
