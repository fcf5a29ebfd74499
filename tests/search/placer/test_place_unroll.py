"""Time-step unrolling of recurrent nodes: the wavefront across stacked LSTM layers (Pal et al. 2019)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hybridpar.cli.main import main
from hybridpar.graph.tracing import trace
from hybridpar.search.placer import place_model
from hybridpar.search.placer.api import build_problem
from hybridpar.search.placer.unroll import split_layers, unroll


class TwoLayerLSTM(nn.Module):
    def __init__(self, width: int = 1024, bidirectional_first: bool = False):
        super().__init__()
        self.l1 = nn.LSTM(width, width // (2 if bidirectional_first else 1), batch_first=True,
                          bidirectional=bidirectional_first)
        self.l2 = nn.LSTM(width, width, batch_first=True)

    def forward(self, x):
        return self.l2(self.l1(x)[0])[0]


def lstm_graph(bidirectional_first: bool = False):
    with torch.device("meta"):
        m = TwoLayerLSTM(bidirectional_first=bidirectional_first)
        x = torch.randn(64, 16, 1024)
    return trace(m, (x,), "lstm2")


def test_unroll_splits_layers_into_tied_chunks_with_recurrence():
    g = lstm_graph()
    u = unroll(g, g, 4)
    names = [n.name for n in u.nodes]
    assert names == ["x", *[f"l1#{t}" for t in range(4)], *[f"l2#{t}" for t in range(4)]]
    assert u.node("l1#2").inputs == ("l1#1", "x")  # the recurrence, then the whole input (a graph input)
    assert u.node("l2#2").inputs == ("l2#1", "l1#2")  # layer l+1 step t reads layer l step t
    assert {u.node(f"l2#{t}").attr("tie") for t in range(4)} == {"l2"}
    assert u.fwd_flops == g.fwd_flops and u.bwd_flops == g.bwd_flops and u.params == g.params
    assert unroll(g, g, 0) is g and unroll(g, g, 1) is g


def test_bidirectional_layer_is_not_split():
    # its step t needs the whole input (the reverse direction), and its chunks would all need it too
    g = lstm_graph(bidirectional_first=True)
    u = unroll(g, g, 4)
    assert "l1" in {n.name for n in u.nodes}
    assert u.node("l2#0").inputs == ("l1",)


def test_problem_chunks_share_work_memory_and_bytes():
    g = lstm_graph()
    whole, *_ = build_problem(g, "dgx1-v100", 2, time_chunks=0)
    split, *_ = build_problem(g, "dgx1-v100", 2, time_chunks=4)
    assert len(split.tasks) == 1 + 2 * 4
    for attr in ("mem_bytes", "grad_bytes"):
        assert sum(getattr(t, attr) for t in split.tasks) == sum(getattr(t, attr) for t in whole.tasks)
    # each chunk is priced at its own shape (cost.compute.chunk_time): on this GPU's roofline, whose
    # per-kernel time a chunk pays again, a little more than the whole layer, never less
    chunked, serial = sum(t.fwd_s[0] + t.bwd_s[0] for t in split.tasks), whole.serial_time_s()
    assert serial < chunked < 1.05 * serial
    assert split.tasks[1].out_bytes == whole.tasks[1].out_bytes // 4
    assert split.tasks[1].grad_bytes == whole.tasks[1].grad_bytes  # gradients complete after chunk 0's backward


def _overlap(result) -> float:
    """Time during which both devices compute at once."""
    spans = [[(s, e) for op, s, e in zip(result.schedule.ops, result.schedule.start, result.schedule.end)
              if op.kind in ("fwd", "bwd") and op.device == d and e > s] for d in range(2)]
    return sum(max(0.0, min(e0, e1) - max(s0, s1)) for s0, e0 in spans[0] for s1, e1 in spans[1])


def test_unrolled_two_layer_lstm_finds_the_wavefront():
    g = lstm_graph()
    whole = place_model(g, "dgx1-v100", 2, time_chunks=0, time_limit_s=10, workers=1)
    split = place_model(g, "dgx1-v100", 2, time_chunks=4, time_limit_s=10, workers=1)
    assert split.result.status == "optimal"
    # without chunks the layers can only run one after the other: nothing to gain from two devices
    # (the MP runtime's loss allreduce per step is its only cost over one process)
    assert whole.result.step_time_s == pytest.approx(whole.single_step_s + whole.problem.step_overhead_s, rel=1e-9)
    assert split.speedup > 1.2  # K = 4: ideally 8 layer-chunks in 5 slots each way, less the transfers
    assert split.plan.placement["l1"] != split.plan.placement["l2"]
    assert _overlap(split.result) > 0.2 * split.result.step_time_s
    assert split.problem.respects_ties(split.result.assignment)


def test_gnmt_whole_or_in_time_chunks_is_priced_as_it_runs(capsys):
    """--time-chunks 1 prices each LSTM whole; --time-chunks K prices the time-step wavefront, which the
    MP runtime runs (parallel/pipeline/wavefront.py): no what-if label, in program order; without the
    option the placer solves both and keeps the shorter predicted step."""
    whole, _, fine, *_ = build_problem("gnmt", "dgx1-v100", 2)
    assert not any(t.tie for t in whole.tasks)
    prob, *_ = build_problem("gnmt", "dgx1-v100", 2, time_chunks=4)
    assert len(prob.tasks) > len(fine) // 2 and any(t.tie for t in prob.tasks)
    args = ["place", "--model", "gnmt", "--devices", "2", "--solver", "greedy", "--json"]
    assert main([*args, "--time-chunks", "1"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    chosen = json.loads(capsys.readouterr().out)
    assert any(n.startswith("time chunks: ") and "chosen" in n for n in chosen["notes"])
    assert main([*args, "--time-chunks", "4"]) == 0
    on = json.loads(capsys.readouterr().out)
    assert on["nodes"] == len(prob.tasks) and off["nodes"] < on["nodes"]
    assert on["single_device_step_s"] == pytest.approx(off["single_device_step_s"], rel=1e-6)
    assert any(n.startswith("time chunks: 4 per recurrent layer") for n in on["notes"])
    assert not any("WHAT-IF" in n for n in off["notes"] + on["notes"])
    assert prob.program_order
    assert chosen["step_time_s"] == pytest.approx(min(off["step_time_s"], on["step_time_s"]), rel=1e-9)
    assert main([*args, "--time-chunks", "-1"]) == 2


@pytest.mark.parametrize("model", ["gnmt", "biglstm"])
def test_plan_runs_every_node_where_the_placer_put_it(model):
    # modules, plus fx node names for functionals and for calls of a dropout reused on two devices
    import hybridpar.parallel.pipeline.partition as partition
    from hybridpar.graph.models import load_model

    out = place_model(model, "dgx1-v100", 2, solver="greedy")
    part = partition.partition_module(load_model(model, device="meta").module, out.plan.placement, 2)
    device_of = {x: d for n, d in zip(out.graph.nodes, out.result.assignment) for x in n.attr("members") or (n.name,)}
    placed = {k: v for k, v in part.device_of.items() if k in device_of and v is not None}
    assert len(placed) >= len(device_of) - 2  # all but the graph inputs
    assert all(v == device_of[k] for k, v in placed.items())
    assert set(out.plan.placement.values()) == {0, 1}


class StackedLSTM(nn.Module):
    def __init__(self, width: int = 1024, layers: int = 4):
        super().__init__()
        self.lstm = nn.LSTM(width, width, num_layers=layers, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[0]


def test_stacked_lstm_layers_are_placed_one_by_one_with_time_chunks():
    """One nn.LSTM(num_layers=4): with time chunks its layers are nodes of their own ('lstm[l]', the MP
    runtime's per-layer keys), each with its layer's weights and FLOPs, and the placer spreads them."""
    from hybridpar.parallel.pipeline.partition import partition_module

    with torch.device("meta"):
        m = StackedLSTM()
        g = trace(m, (torch.randn(64, 16, 1024),), "stacked")
    whole = place_model(g, "dgx1-v100", 2, time_chunks=0, time_limit_s=10, workers=1)
    split = place_model(g, "dgx1-v100", 2, time_chunks=4, time_limit_s=10, workers=1)
    assert set(whole.plan.placement) == {"lstm"}
    layers = {k: v for k, v in split.plan.placement.items() if k.startswith("lstm[")}
    assert sorted(layers) == [f"lstm[{i}]" for i in range(4)] and set(layers.values()) == {0, 1}
    assert split.plan.time_chunks == 4 and whole.plan.time_chunks == 1
    assert split.speedup > 1.3 > whole.speedup
    layered = split_layers(g)
    assert (layered.fwd_flops, layered.bwd_flops, layered.params) == (g.fwd_flops, g.bwd_flops, g.params)
    part = partition_module(StackedLSTM(8), split.plan.placement, 2, time_chunks=4)
    assert {part.owner_of_key[f"lstm.weight_ih_l{i}"] for i in range(4)} == {0, 1}


class LastStep(StackedLSTM):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(1024, 10)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])  # an op no module runs, placed by its input: the last layer


def test_runtime_moves_the_bytes_the_placer_priced_for_time_chunks():
    """The wavefront the runtime runs for the placer's chunked placement crosses devices chunk by chunk
    with exactly the bytes the placer priced (the output of a stacked module leaves from its last layer)."""
    from hybridpar.parallel.pipeline.executor import meta_copy, meta_values
    from hybridpar.parallel.pipeline.partition import partition_module
    from hybridpar.search.placer.module_placement import predicted_p2p_bytes

    with torch.device("meta"):
        m = LastStep()
        x = torch.randn(64, 16, 1024)
    out = place_model(trace(m, (x,), "stacked_head"), "dgx1-v100", 2, time_chunks=4, time_limit_s=10, workers=1)
    assert len({v for k, v in out.plan.placement.items() if "[" in k}) == 2
    part = partition_module(m, out.plan.placement, 2, time_chunks=4)
    values = meta_values(part, meta_copy(m), (x,))
    moved = sum(t.numel() * t.element_size() for tr in part.transfers
                for t in torch.utils._pytree.tree_flatten(values[tr.node])[0] if isinstance(t, torch.Tensor))
    assert len(part.transfers) >= 4 and 2 * moved == predicted_p2p_bytes(out)
