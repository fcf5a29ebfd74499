"""Cheaper DTensor sharding propagation on the meshes of spatial layouts.

DTensor expands an op's single-mesh-dim strategies to a mesh of m dims as their m-fold product
(torch 2.13 `_ops.utils.expand_to_full_mesh_op_strategy`, called by single-dim strategies), pricing
every combination: k^m of them. A spatial layout's activation mesh has 3 or 4 dims (sample, the split
spatial dims, channel_filter), sizes 1 included, so a pointwise op on an [N, C, H, W] activation has
6^4 combinations; py-spy put ~90% of a small U-Net's first step there (tests/parallel/
test_spatial_model.py: ~100 s of the first step on 4 gloo ranks, 0.3 s for the next steps, which hit
DTensor's cache).

Here, on those meshes only, a strategy is offered only if each input's placement in it is one that
input already has on some mesh dim, or Replicate. The combination that keeps every input where it is
(no redistribution) is still among them, and so is replicating everything; a combination left out
would move an input to a placement it has nowhere, which costs a collective that one of these avoids.
If none is left, DTensor's own list is used.
"""

from __future__ import annotations

import weakref

from torch.distributed.tensor import Replicate

_MESHES: weakref.WeakSet = weakref.WeakSet()
_ORIGINAL = None


def register(mesh) -> None:
    """Use the filtered expansion for ops on `mesh` (installs the wrapper once)."""
    global _ORIGINAL
    from torch.distributed.tensor._ops import utils

    if _ORIGINAL is None:
        _ORIGINAL = utils.expand_to_full_mesh_op_strategy
        utils.expand_to_full_mesh_op_strategy = _expand
    _MESHES.add(mesh)


def _expand(mesh, op_schema, single_mesh_dim_strategies, *args, input_index: int = 1, **kwargs):
    assert _ORIGINAL is not None
    if mesh in _MESHES:
        kept = _filtered(op_schema, single_mesh_dim_strategies, input_index)
        if kept:
            single_mesh_dim_strategies = kept
    return _ORIGINAL(mesh, op_schema, single_mesh_dim_strategies, *args, input_index=input_index, **kwargs)


def _filtered(op_schema, strategies, input_index: int) -> list:
    inputs = [*op_schema.args_strategy, *op_schema.kwargs_strategy]
    have = []
    for s in inputs:
        if len(s.strategies) != 1:
            return []  # several candidate specs for an input: leave DTensor's list alone
        have.append({*s.strategies[0].output_spec.placements, Replicate()})
    kept = []
    for strategy in strategies:
        ins = [p for p in strategy[input_index:] if p is not None]
        if len(ins) != len(have):
            return []
        if all(p in h for p, h in zip(ins, have)):
            kept.append(strategy)
    return kept
