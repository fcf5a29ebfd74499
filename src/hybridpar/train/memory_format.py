"""Channels-last (NHWC) memory format for a run (`hybridpar train --channels-last`).

A memory format changes how a 4-D tensor's elements lie in memory, not their values: convolutions,
batch norm and pooling give the same results up to the order of a kernel's float sums. It changes
speed: cuDNN's tensor-core convolutions and oneDNN's CPU convolutions run NHWC natively, and a
convolution whose input or weight is channels-last returns a channels-last output, so converting the
model's 4-D weights once and each batch's 4-D inputs keeps every image activation channels-last.

What is converted: every 4-D floating parameter and buffer of the model as built for this rank (plain
tensors, and DTensor pieces through DTensor's own clone rule), and every 4-D floating input of each
batch. Not converted: parameters FSDP2 manages (`zero` 2/3: fully_shard keeps its own flat storage of
each sharded parameter, which swapping a parameter's data would detach from; their convolutions still
run channels-last from their channels-last inputs), and 5-D tensors (channels_last_3d is a separate
format: 3-D models are left NCDHW).
"""

from __future__ import annotations

import torch
from torch import nn


def _fsdp_managed(module: nn.Module) -> set[int]:
    """ids of the parameters FSDP2's fully_shard manages in `module` (none without FSDP)."""
    from torch.distributed.fsdp import FSDPModule

    return {id(p) for m in module.modules() if isinstance(m, FSDPModule) for p in m.parameters()}


def _is_image(t: torch.Tensor) -> bool:
    return t.dim() == 4 and t.is_floating_point()


def module_to_channels_last(module: nn.Module) -> int:
    """Convert `module`'s 4-D floating parameters and buffers to channels-last in place (the same
    Parameter objects: an optimizer made before or after sees them); returns how many were converted."""
    skip = _fsdp_managed(module)
    n = 0
    with torch.no_grad():
        for p in module.parameters():
            if id(p) not in skip and _is_image(p):
                p.data = p.data.contiguous(memory_format=torch.channels_last)
                n += 1
        for sub in module.modules():
            for name, b in sub.named_buffers(recurse=False):
                if b is not None and _is_image(b):
                    setattr(sub, name, b.contiguous(memory_format=torch.channels_last))
                    n += 1
    return n


def inputs_to_channels_last(x):
    """A batch's 4-D floating inputs (a tensor, a tuple/list or dict of them) channels-last; other
    inputs (token ids, masks, vectors, 3-D volumes) as they are."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.contiguous(memory_format=torch.channels_last)
                    if isinstance(t, torch.Tensor) and _is_image(t) else t, x)
