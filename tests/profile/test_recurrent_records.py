"""Recurrent modules in the calibration file: `profile --model` times a stacked nn.LSTM one layer at a
time, the cost model prices the stack as the sum of its layers (a 4-layer LSTM left unprofiled was priced
at 6.6x its one-process step), and a GRU or a stack is never filed under one LSTM layer's key."""

import pytest
import torch
from torch import nn

from hybridpar.cluster.calibration import Calibration, Measurement, OpRecord
from hybridpar.cost.compute import chunk_time, local_shapes, op_time
from hybridpar.graph import trace
from hybridpar.graph.recurrent import record_op
from hybridpar.profile import ops
from hybridpar.profile.graph_ops import profile_graph_ops


class _Lm(nn.Module):
    def __init__(self, cell: type[nn.RNNBase] = nn.LSTM, layers: int = 3, bidirectional: bool = False):
        super().__init__()
        self.emb = nn.Embedding(40, 8)
        self.rnn = cell(8, 12, num_layers=layers, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(12 * (2 if bidirectional else 1), 40)

    def forward(self, tokens):
        y, _ = self.rnn(self.emb(tokens))
        return self.head(y)


def _graph(module):
    tokens = torch.randint(0, 40, (4, 6))
    return trace(module, (tokens,), train=True), (tokens,)


def _rnn_node(graph):
    return next(n for n in graph.nodes if n.op == "lstm")


def _dev():
    from hybridpar.cluster import load_cluster

    return load_cluster("localhost", gpus=2).device


def _m(s: float) -> Measurement:
    return Measurement(median_s=s, p10_s=s, p90_s=s, repeats=3)


def _cal(records: dict[str, tuple[float, float, float]]) -> Calibration:
    ops_ = {k: OpRecord(key=k, op=k.split("|")[0], fwd=_m(f), bwd_data=_m(d), bwd_weight=_m(w))
            for k, (f, d, w) in records.items()}
    return Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10, ops=ops_)


def test_a_stacked_lstm_is_profiled_layer_by_layer():
    module = _Lm(layers=3)
    specs = [s for s in ops.collect_op_specs(module, (torch.randint(0, 40, (4, 6)),)) if s.op == "lstm"]
    # each layer also at its time chunks' steps (6 steps in the default 4 chunks: 2, 2, 1, 1)
    assert [(s.x, s.y) for s in specs] == [((4, 6, 8), (4, 6, 12)), ((4, 6, 12), (4, 6, 12)),
                                           ((4, 2, 8), (4, 2, 12)), ((4, 2, 12), (4, 2, 12)),
                                           ((4, 1, 8), (4, 1, 12)), ((4, 1, 12), (4, 1, 12))]


def test_a_time_chunk_is_priced_at_its_own_shape():
    """The wavefront's chunk t of K runs the layer over its own steps: its record, not 1/K of the layer's
    (a chunk costs more than that: measured 29 vs 24 ms per layer for bench_mp's LSTM in 4 chunks)."""
    graph, _ = _graph(_Lm(layers=1))
    node = _rnn_node(graph)
    share = _dev().time_share
    whole_key, chunk_key = "lstm|x=4x6x8|w=-|y=4x6x12", "lstm|x=4x2x8|w=-|y=4x2x12"
    cal = _cal({whole_key: (6.0, 12.0, 18.0), chunk_key: (3.0, 5.0, 7.0)})
    t = chunk_time(node, 0, 4, 1, _dev(), calibration=cal)  # 6 steps in 4 chunks: chunk 0 has 2
    assert (t.source, t.fwd_s, t.bwd_s) == ("measured", pytest.approx(3.0 * share), pytest.approx(12.0 * share))
    # no record of the chunk's shape: the whole layer's in proportion to its steps, labelled so
    t = chunk_time(node, 3, 4, 1, _dev(), calibration=cal)  # chunk 3 has 1 step
    assert (t.source, t.fwd_s) == ("measured-scaled", pytest.approx(1.0 * share))
    # nothing measured: the roofline of the chunk's shape
    assert chunk_time(node, 0, 4, 1, _dev(), calibration=_cal({})).source == "roofline"


def test_record_names_tell_cells_stacks_and_directions_apart():
    names = {record_op(_rnn_node(_graph(m)[0]))
             for m in (_Lm(layers=1), _Lm(layers=3), _Lm(nn.GRU, layers=1), _Lm(nn.GRU, layers=2),
                       _Lm(layers=1, bidirectional=True))}
    assert names == {"lstm", "lstm*3", "gru", "gru*2", "lstm-bi"}


def test_a_stack_is_priced_as_the_sum_of_its_measured_layers():
    graph, _ = _graph(_Lm(layers=3))
    node = _rnn_node(graph)
    cal = _cal({"lstm|x=4x6x8|w=-|y=4x6x12": (1.0, 2.0, 3.0), "lstm|x=4x6x12|w=-|y=4x6x12": (10.0, 20.0, 30.0)})
    t = op_time(node, _dev(), calibration=cal)
    share = _dev().time_share
    assert t.source == "measured"
    assert t.fwd_s == pytest.approx((1 + 2 * 10) * share)
    assert t.bwd_weight_s == pytest.approx((3 + 2 * 30) * share)
    # a record of the whole stack, where the graph path timed it, is taken as it is
    whole = _cal({"lstm*3|x=4x6x8|w=-|y=4x6x12": (5.0, 6.0, 7.0)})
    assert op_time(node, _dev(), calibration=whole).fwd_s == pytest.approx(5.0 * share)


def test_a_gru_does_not_take_an_lstm_layers_time():
    graph, _ = _graph(_Lm(nn.GRU, layers=1))
    node = _rnn_node(graph)
    cal = _cal({"lstm|x=4x6x8|w=-|y=4x6x12": (1.0, 2.0, 3.0)})
    assert op_time(node, _dev(), calibration=cal).source == "roofline"


@pytest.mark.timeout(120)
def test_profiling_a_stacked_lstm_model_measures_its_stack():
    """The hook path (layers) and the graph path (everything else) together: the stack's op time at
    each batch split is measured, and no whole-stack time is filed under a one-layer key."""
    module = _Lm(layers=2)
    graph, inputs = _graph(module)
    specs = ops.split_variants(ops.collect_op_specs(module, inputs), (2,))
    records, _ = profile_graph_ops(module, inputs, graph, (2,), {s.key for s in specs}, warmup=1, repeats=2)
    assert not any(k.startswith("lstm|") for k in records)
    node = _rnn_node(graph)
    for frac in (1.0, 0.5):
        rec = records[local_shapes(node, frac).key(record_op(node))]
        # one backward call (its kernel computes the input and weight gradients together): timed apart,
        # each pass would be the whole backward, counted twice
        assert rec.bwd_weight is None and rec.bwd_data.median_s > 0
