"""FLOPs of opaque leaf modules, measured with FlopCounterMode on the meta device.

torch.fx keeps every torch.nn module as a leaf, including composite ones our rules do not model
(nn.TransformerEncoderLayer, nn.MultiheadAttention, nn.GRU, ...). Rather than report 0 FLOPs for them,
we run the module again on meta tensors under FlopCounterMode: forward and full backward, then backward
with only the weights requiring a gradient (bwd_weight); bwd_data is the difference.
Such nodes carry attrs `flops_source="flop_counter"`; being FlopCounterMode's own figures, they count
only what it counts (matmuls, convolutions, attention).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from hybridpar.graph.flops import Flops


def measure_module(mod: nn.Module, args: tuple, kwargs: dict) -> Flops:
    fwd, bwd_all = _run(mod, args, kwargs, input_grad=True, weight_grad=True)
    _, bwd_weight = _run(mod, args, kwargs, input_grad=False, weight_grad=True)
    # bwd_weight includes the gradient propagation inside the module that the weights need;
    # bwd_data is the extra work for the input's gradient, so the two add up to one full backward.
    return Flops(fwd, bwd_all - bwd_weight, bwd_weight)


def _meta_like(t: torch.Tensor, grad: bool) -> torch.Tensor:
    x = torch.empty_like(t, device="meta")
    return x.requires_grad_(grad and x.is_floating_point())


def _run(mod: nn.Module, args: tuple, kwargs: dict, *, input_grad: bool, weight_grad: bool) -> tuple[int, int]:
    state = {k: _meta_like(v, weight_grad) for k, v in mod.named_parameters()}
    state.update({k: _meta_like(v, False) for k, v in mod.named_buffers()})
    margs = tuple(_meta_like(a, input_grad) if isinstance(a, torch.Tensor) else a for a in args)
    with FlopCounterMode(display=False) as fwd:
        out = torch.func.functional_call(mod, state, margs, kwargs)
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs:
        return fwd.get_total_flops(), 0
    with FlopCounterMode(display=False) as bwd:
        torch.autograd.backward([t.sum() for t in outs])
    return fwd.get_total_flops(), bwd.get_total_flops()
