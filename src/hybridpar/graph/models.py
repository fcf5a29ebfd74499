"""Resolve `--model`: a zoo name or `path/to/file.py:factory`."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hybridpar.errors import UserError


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


def load_model(spec: str, *, batch: int | None = 1, input_shape: tuple[int, ...] | None = None,
               device: str | torch.device | None = None, **overrides) -> LoadedModel:
    """Build the module and example inputs for `spec` at `batch` samples.

    `device="meta"` builds a zoo model without allocating weights (enough for tracing and FLOPs);
    a user's factory always builds where it chooses to. `batch=None` keeps the example batch a
    factory returned (1 for zoo models)."""
    if batch is not None and batch < 1:
        raise UserError(f"batch must be >= 1, got {batch}")
    if ":" in spec or spec.endswith(".py"):
        return _load_factory(spec, batch, input_shape)
    from hybridpar.graph.zoo import ZOO

    entry = ZOO.get(spec)
    if entry is None:
        raise UserError(f"unknown model {spec!r}; known: {', '.join(sorted(ZOO))} "
                        "(or path/to/file.py:factory)")
    shape = tuple(input_shape) if input_shape else entry.input_shape
    batch = batch or 1
    if entry.kind == "cnn" and len(shape) != 3:
        raise UserError(f"model {spec!r} takes images: --input-shape C,H,W, got {','.join(map(str, shape))}")
    if device is None:
        module = entry.build(**overrides)
        inputs = entry.example_inputs(batch, shape)
    else:
        with torch.device(device):
            module = entry.build(**overrides)
        inputs = tuple(x.to(device) for x in entry.example_inputs(batch, shape))
    return LoadedModel(spec, module, inputs, entry.kind, shape)


def _load_factory(spec: str, batch: int | None, input_shape: tuple[int, ...] | None) -> LoadedModel:
    path_s, _, fn_name = spec.rpartition(":") if ":" in spec else (spec, "", "model")
    path = Path(path_s)
    if not path.is_file():
        raise UserError(f"model file {path_s!r} not found")
    try:
        mod_name = f"_hybridpar_user_{abs(hash(str(path.resolve())))}"
        mspec = importlib.util.spec_from_file_location(mod_name, path)
        if mspec is None or mspec.loader is None:
            raise UserError(f"cannot import {path_s!r} as Python")
        module = importlib.util.module_from_spec(mspec)
        sys.modules[mod_name] = module
        mspec.loader.exec_module(module)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 -- a user's file can raise anything on import
        raise UserError(f"cannot import model file {path_s!r}: {type(err).__name__}: {err}") from None
    factory = getattr(module, fn_name or "model", None)
    if not callable(factory):
        raise UserError(f"{path_s!r} has no callable {fn_name!r}")
    try:
        made = factory()
    except Exception as err:  # noqa: BLE001 -- so can their factory
        raise UserError(f"model factory {spec!r} raised {type(err).__name__}: {err}") from None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        net, inputs = made
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        shape = tuple(inputs[0].shape[1:]) if isinstance(inputs[0], torch.Tensor) else input_shape
        given = int(inputs[0].shape[0]) if isinstance(inputs[0], torch.Tensor) and inputs[0].dim() else 1
        if input_shape is not None or (batch is not None and batch != given):
            shape = input_shape or shape
            inputs = (torch.randn(batch or given, *shape, generator=torch.Generator().manual_seed(0)),)
        return LoadedModel(spec, net, inputs, "custom", shape)
    if not isinstance(made, nn.Module):
        raise UserError(f"model factory {spec!r} returned {type(made).__name__}, not an nn.Module")
    if input_shape is None:
        raise UserError(f"model {spec!r}: give --input-shape C,H,W (or return (module, example_inputs))")
    inputs = (torch.randn(batch or 1, *input_shape, generator=torch.Generator().manual_seed(0)),)
    return LoadedModel(spec, made, inputs, "custom", tuple(input_shape))
