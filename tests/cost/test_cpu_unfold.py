"""CPU convolutions that ATen runs by unfolding their input (cost.memory.cpu_unfold_bytes): a CosmoFlow-
like 3-D CNN at batch 1 allocates a column buffer per convolution in backward, which the memory model
now counts on CPU devices (its step peak was predicted at half the measured before)."""

from __future__ import annotations

import torch
from torch import nn

from hybridpar.cost.memory import cpu_unfold_bytes, predict_rank_memory
from hybridpar.graph import trace
from hybridpar.profile.step_memory import Case, measure_step, predicted_step_bytes


def _conv_node(conv: nn.Module, shape: tuple[int, ...]):
    g = trace(nn.Sequential(conv), (torch.randn(*shape),), "one_conv")
    return next(n for n in g.nodes if n.op.startswith("conv"))


def test_which_convolutions_unfold():
    node = _conv_node(nn.Conv3d(4, 32, 3, padding=1), (1, 4, 16, 16, 16))
    # C_in x 27 taps x the output's 16^3 voxels, fp32
    assert cpu_unfold_bytes(node, 1, 1, 4) == 4 * 27 * 16**3 * 4
    assert cpu_unfold_bytes(node, 2, 1, 4) == 0  # batch 2: oneDNN
    assert cpu_unfold_bytes(node, 2, 2, 4) == cpu_unfold_bytes(node, 1, 1, 4)  # one sample per rank
    assert cpu_unfold_bytes(node, 1, 1, 2) == 0  # bf16: another kernel
    assert cpu_unfold_bytes(_conv_node(nn.Conv3d(4, 8, 3, padding=1, groups=2), (1, 4, 16, 16, 16)), 1, 1, 4) == 0
    assert cpu_unfold_bytes(_conv_node(nn.Conv3d(4, 8, 5, padding=2), (1, 4, 16, 16, 16)), 1, 1, 4) == 0
    assert cpu_unfold_bytes(_conv_node(nn.Conv3d(4, 8, 1), (1, 4, 16, 16, 16)), 1, 1, 4) == 0
    big = _conv_node(nn.Conv2d(8, 16, 3, padding=1), (1, 8, 48, 64))  # 8 x 48 x 64 > 20480: oneDNN
    assert cpu_unfold_bytes(big, 1, 1, 4) == 0
    small = _conv_node(nn.Conv2d(8, 16, 3, padding=1), (1, 8, 40, 64))
    assert cpu_unfold_bytes(small, 1, 1, 4) == 8 * 9 * 40 * 64 * 4


def test_a_3d_cnn_step_at_batch_1_is_predicted_with_its_column_buffers():
    case = Case("cosmoflow", (4, 32, 32, 32), 1)
    model, x, y = case.build()
    measured = measure_step(model, x, y).peak_bytes
    predicted = predicted_step_bytes(case, "sample=1")
    assert abs(predicted / measured - 1) <= 0.15, (predicted, measured)
    # a GPU's figure (framework_bytes 0: no unfolded CPU kernels) misses about half of this step
    graph = trace(model, (x,), "cosmoflow")
    gpu = predict_rank_memory(graph, "sample=1", batch=1, framework_bytes=0)
    assert gpu.transient_bytes < 0.5 * predict_rank_memory(graph, "sample=1", batch=1).transient_bytes
