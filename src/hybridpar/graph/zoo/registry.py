"""Zoo registry: name -> factory, default input, and the published reference for its size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class ZooEntry:
    name: str
    factory: Callable[..., nn.Module]
    kind: str  # "cnn" (image input N,C,H,W) or "seq" (token input)
    input_shape: tuple[int, ...]  # per-sample shape: (C,H,W) for cnn, (T,) for seq
    description: str
    reference: str
    published_params: int | None = None
    num_classes: int | None = None
    kwargs: dict = field(default_factory=dict)
    # Builds the example inputs for a batch; default: float images / token ids.
    make_inputs: Callable[[int, tuple[int, ...]], tuple[torch.Tensor, ...]] | None = None
    vocab: int | None = None

    def build(self, **overrides) -> nn.Module:
        return self.factory(**{**self.kwargs, **overrides})

    def example_inputs(self, batch: int, input_shape: tuple[int, ...] | None = None) -> tuple:
        shape = tuple(input_shape or self.input_shape)
        if self.make_inputs is not None:
            return self.make_inputs(batch, shape)
        if self.kind == "seq":
            # Token ids below 32 stay valid when a smaller vocabulary is passed as an override.
            g = torch.Generator().manual_seed(0)
            return (torch.randint(0, min(self.vocab or 32, 32), (batch, *shape), generator=g),)
        return (torch.randn(batch, *shape, generator=torch.Generator().manual_seed(0)),)


ZOO: dict[str, ZooEntry] = {}


def register(name: str, *, kind: str, input_shape: tuple[int, ...], description: str, reference: str,
             published_params: int | None = None, num_classes: int | None = None,
             make_inputs=None, vocab: int | None = None, **kwargs):
    """Decorator: register `factory` under `name` (kwargs are passed to the factory)."""

    def deco(factory: Callable[..., nn.Module]):
        ZOO[name] = ZooEntry(name, factory, kind, tuple(input_shape), description, reference,
                             published_params, num_classes, dict(kwargs), make_inputs, vocab)
        return factory

    return deco
