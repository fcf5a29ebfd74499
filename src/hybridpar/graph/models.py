"""Resolve `--model`: a zoo name or `path/to/file.py:factory`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridpar.errors import UserError
from hybridpar.user_code import call_factory


@dataclass(frozen=True)
class LoadedModel:
    name: str
    module: nn.Module
    example_inputs: tuple
    kind: str  # "cnn" | "seq" | "custom"
    input_shape: tuple[int, ...] | None


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    if text is None or text == "":
        return None
    try:
        dims = tuple(int(t) for t in str(text).replace("x", ",").split(","))
    except ValueError:
        raise UserError(f"--input-shape {text!r}: expected comma-separated positive integers, e.g. 3,32,32") from None
    if not dims or any(d < 1 for d in dims):
        raise UserError(f"--input-shape {text!r}: dimensions must be positive integers")
    return dims


MAX_BATCH = 2**31 - 1


def load_model(spec: str, *, batch: int | None = 1, input_shape: tuple[int, ...] | None = None,
               device: str | torch.device | None = None, **overrides) -> LoadedModel:
    """Build the module and example inputs for `spec` at `batch` samples.

    `device="meta"` builds a zoo model without allocating weights (enough for tracing and FLOPs);
    a user's factory always builds where it chooses to. `batch=None` keeps the example batch a
    factory returned (1 for zoo models)."""
    if batch is not None and batch < 1:
        raise UserError(f"batch must be >= 1, got {batch}")
    if batch is not None and batch > MAX_BATCH:  # torch sizes are int64; no real batch comes near
        raise UserError(f"batch {batch} is too large (at most {MAX_BATCH:,})")
    if ":" in spec or spec.endswith(".py"):
        return _load_factory(spec, batch, input_shape, device)
    from hybridpar.graph.zoo import ZOO

    entry = ZOO.get(spec)
    if entry is None:
        raise UserError(f"unknown model {spec!r}; known: {', '.join(sorted(ZOO))} "
                        "(or path/to/file.py:factory)")
    shape = tuple(input_shape) if input_shape else entry.input_shape
    batch = batch or 1
    if entry.kind == "cnn" and len(shape) != len(entry.input_shape):  # images C,H,W; volumes C,D,H,W
        dims = "C,H,W" if len(entry.input_shape) == 3 else "C,D,H,W"
        raise UserError(f"model {spec!r} takes {len(entry.input_shape) - 1}-D inputs: --input-shape {dims}, "
                        f"got {','.join(map(str, shape))}")
    if device is None:
        module = entry.build(**overrides)
        inputs = entry.example_inputs(batch, shape)
    else:
        with torch.device(device):  # inputs made there too: on meta an input of any size costs nothing
            module = entry.build(**overrides)
            inputs = tuple(x.to(device) for x in entry.example_inputs(batch, shape))
    return LoadedModel(spec, module, inputs, entry.kind, shape)


def _load_factory(spec: str, batch: int | None, input_shape: tuple[int, ...] | None,
                  device: str | torch.device | None = None) -> LoadedModel:
    made = call_factory(spec, "model", "model file")
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        net, inputs = made
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        if not inputs:
            raise UserError(f"model factory {spec!r} returned no example inputs")
        inputs = rebatch(inputs, batch, input_shape, spec=spec)
        first = inputs[0]
        shape = tuple(first.shape[1:]) if isinstance(first, torch.Tensor) and first.dim() else input_shape
        return LoadedModel(spec, net, inputs, "custom", shape)
    if not isinstance(made, nn.Module):
        raise UserError(f"model factory {spec!r} returned {type(made).__name__}, not an nn.Module")
    if input_shape is None:
        raise UserError(f"model {spec!r}: give --input-shape C,H,W (or return (module, example_inputs))")
    meta = device is not None and torch.device(device).type == "meta"  # shapes only: nothing allocated
    inputs = (torch.randn(batch or 1, *input_shape, generator=torch.Generator().manual_seed(0),
                          device="meta" if meta else None),)
    return LoadedModel(spec, made, inputs, "custom", tuple(input_shape))


def rebatch(inputs: tuple, batch: int | None, input_shape: tuple[int, ...] | None = None, *,
            spec: str = "model") -> tuple:
    """A factory's example inputs at `batch` samples, every input kept with its dtype.

    The example batch is the leading dimension of the first tensor input. Every tensor (also inside
    tuples, lists and dicts) whose leading dimension is that batch is cut or tiled to `batch` rows,
    each row a copy of one of the example's rows, so token ids stay valid ids, masks stay masks and
    every input after the first is kept. Other values (and tensors of another leading size) are
    passed unchanged. `input_shape` replaces the first input's per-sample shape with new values of
    its dtype: floating point from a seeded normal, integers drawn within the example's own range,
    booleans all True."""
    from torch.utils._pytree import tree_map

    first = inputs[0]
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        if input_shape is not None:
            raise UserError(f"model {spec!r}: --input-shape needs a tensor as the first example input")
        return inputs
    given = int(first.shape[0])
    want = batch or given
    if input_shape is not None and tuple(input_shape) != tuple(first.shape[1:]):
        first = _fresh_like(first, (given, *input_shape))
        inputs = (first, *inputs[1:])
    if want == given:
        return inputs
    if given < 1:
        raise UserError(f"model {spec!r}: the example inputs have batch 0; cannot re-batch them")
    rows = torch.arange(want) % given

    def take(x):
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == given:
            return x[rows.to(x.device)]  # the same ops on meta and on CPU (the materialiser replays them)
        return x

    return tuple(tree_map(take, x) for x in inputs)


def _fresh_like(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    # Floating and boolean inputs run the same ops on meta as on CPU (parallel/materialize.py records a
    # factory on meta and replays it, this included, on CPU); integers need the example's values.
    g = torch.Generator().manual_seed(0)
    if x.dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool, device=x.device)
    if x.is_floating_point() or x.is_complex():
        on = "meta" if x.device.type == "meta" else "cpu"  # the generator is a CPU one
        return torch.randn(shape, generator=g, dtype=x.dtype, device=on).to(x.device)
    if x.device.type == "meta":
        return x.new_empty(shape)
    lo, hi = (int(x.min()), int(x.max())) if x.numel() else (0, 0)
    return torch.randint(lo, hi + 1, shape, generator=g, dtype=x.dtype).to(x.device)
