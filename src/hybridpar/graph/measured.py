"""FLOPs of opaque leaf modules, measured with FlopCounterMode on the meta device.

torch.fx keeps every torch.nn module as a leaf, including composite ones our rules do not model
(nn.TransformerEncoderLayer, nn.MultiheadAttention, ...). The tracer then prefers torch.export, which
splits them into priced ops; where export cannot trace the model, rather than report 0 FLOPs for them
we run the module again on meta tensors (on detached real copies if meta cannot run it) under
FlopCounterMode: forward and full backward, then backward
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
    """Meta tensors first; a module that builds real tensors inside forward is run on detached copies
    of its real arguments and weights instead (the model's own weights and grads are not touched)."""
    try:
        return _measure(mod, args, kwargs, _meta_like)
    except Exception:  # noqa: BLE001 -- meta cannot run it: measure for real, or let that error out
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in args) or any(
                t.is_meta for t in (*mod.parameters(), *mod.buffers())):
            raise
        return _measure(mod, args, kwargs, _real_like)


def _measure(mod: nn.Module, args: tuple, kwargs: dict, like) -> Flops:
    fwd, bwd_all = _run(mod, args, kwargs, input_grad=True, weight_grad=True, like=like)
    _, bwd_weight = _run(mod, args, kwargs, input_grad=False, weight_grad=True, like=like)
    # bwd_weight includes the gradient propagation inside the module that the weights need;
    # bwd_data is the extra work for the input's gradient, so the two add up to one full backward.
    return Flops(fwd, bwd_all - bwd_weight, bwd_weight)


def _meta_like(t: torch.Tensor, grad: bool) -> torch.Tensor:
    x = torch.empty_like(t, device="meta")
    return x.requires_grad_(grad and x.is_floating_point())


def _real_like(t: torch.Tensor, grad: bool) -> torch.Tensor:
    x = t.detach().clone()
    return x.requires_grad_(grad and x.is_floating_point())


def _run(mod: nn.Module, args: tuple, kwargs: dict, *, input_grad: bool, weight_grad: bool,
         like=_meta_like) -> tuple[int, int]:
    state = {k: like(v, weight_grad) for k, v in mod.named_parameters()}
    state.update({k: like(v, False) for k, v in mod.named_buffers()})
    margs = tuple(like(a, input_grad) if isinstance(a, torch.Tensor) else a for a in args)
    with FlopCounterMode(display=False) as fwd:
        out = torch.func.functional_call(mod, state, margs, kwargs)
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs:
        return fwd.get_total_flops(), 0
    with FlopCounterMode(display=False) as bwd:
        torch.autograd.backward([t.sum() for t in outs])
    return fwd.get_total_flops(), bwd.get_total_flops()
