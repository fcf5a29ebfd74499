"""The FLOP reference: torch.utils.flop_counter.FlopCounterMode over one training step, with the
model's attention run eagerly (FlopCounterMode has no formula for CPU's fused attention kernel).

One correction, stated here and applied only here: FlopCounterMode (torch 2.13) counts the weight
gradient of a grouped convolution as if it were ungrouped, `groups` times the multiply-adds that are
done (a depthwise 3x3 conv over 8 channels: 36,864 FLOPs for a 4,608-FLOP weight gradient). The
reference divides that term by `groups`; everything else is FlopCounterMode's own count.
"""

from __future__ import annotations

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

aten = torch.ops.aten


def _conv_backward(grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation, transposed,
                   output_padding, groups, output_mask, out_shape=None, **kwargs) -> int:
    """torch.utils.flop_counter.conv_backward_flop with the weight-gradient term divided by groups."""
    def t(shape):
        return [shape[1], shape[0], *shape[2:]]

    count = flop_counter.conv_flop_count
    total = 0
    if output_mask[0]:
        total += count(grad_out_shape, w_shape, flop_counter.get_shape(out_shape[0]), not transposed)
    if output_mask[1]:
        gw = flop_counter.get_shape(out_shape[1])
        a, b = (grad_out_shape, x_shape) if transposed else (x_shape, grad_out_shape)
        total += count(t(a), t(b), t(gw), transposed=False) // groups
    return total


def counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping={aten.convolution_backward: _conv_backward})


def _tensors(y) -> list[torch.Tensor]:
    if isinstance(y, torch.Tensor):
        return [y]
    return [t for t in y if isinstance(t, torch.Tensor)]


def step_flops(module: torch.nn.Module, inputs: tuple) -> tuple[int, int]:
    """(forward, backward) FLOPs of one training step of `module` on `inputs`."""
    with counter() as fwd:
        y = module(*inputs)
    with counter() as bwd:
        sum(t.float().sum() for t in _tensors(y)).backward()
    return fwd.get_total_flops(), bwd.get_total_flops()
