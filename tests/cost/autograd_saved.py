"""What autograd really keeps for backward: the ground truth of the memory model's tests."""

from __future__ import annotations

import torch
from torch import nn


def saved_bytes(model: nn.Module, inputs: tuple) -> int:
    """Bytes of the distinct storages autograd saves for backward, less parameters, buffers and inputs."""
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
    outside = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *inputs]}
    return sum(v for k, v in saved.items() if k not in outside)
