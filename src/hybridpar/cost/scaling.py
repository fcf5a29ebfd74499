"""A traced graph priced at another batch size: its shapes and FLOPs (all linear in the batch).

Graphs are traced once at a small batch (the planner's cache: batch 1) and priced at the batch asked
for. Where the batch sits in a tensor is not recorded by the tracer, so it is inferred from the traced
batch (`shape_at_batch`): the first dimension when that equals the traced batch; otherwise the tensor
is time-major, as inside nn.MultiheadAttention (always) and nn.LSTM/GRU without batch_first:
(steps, batch, ...), or (steps x batch, features) where the attention flattens them for its output
projection. Approximation: a dimension equal to the traced batch by chance is taken for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hybridpar.graph.types import Graph


def shape_at_batch(shape: Sequence[int], batch: int, graph_batch: int | None) -> tuple[int, ...]:
    """`shape`, traced at `graph_batch` samples, at `batch` samples (module docstring's rule)."""
    shape = tuple(shape)
    gb = graph_batch or batch
    if not shape or gb == batch:
        return shape
    if shape[0] == gb:
        return (batch, *shape[1:])
    if len(shape) >= 2 and shape[1] == gb:  # (steps, batch, ...)
        return (shape[0], batch, *shape[2:])
    return (max(1, round(shape[0] * batch / gb)), *shape[1:])  # (steps x batch, ...)


def graph_at_batch(graph: Graph, batch: int) -> Graph:
    """`graph` with every node's shapes (`shape_at_batch`) and FLOPs at the global batch `batch`."""
    b0 = graph.batch or 1
    if batch == b0:
        return graph
    k = batch / b0

    def shape(s: tuple[int, ...]) -> tuple[int, ...]:
        return shape_at_batch(s, batch, b0)

    nodes = tuple(dataclasses.replace(
        n, in_shapes=tuple(shape(s) for s in n.in_shapes), out_shape=shape(n.out_shape),
        fwd_flops=int(n.fwd_flops * k), bwd_data_flops=int(n.bwd_data_flops * k),
        bwd_weight_flops=int(n.bwd_weight_flops * k)) for n in graph.nodes)
    return dataclasses.replace(graph, nodes=nodes, batch=batch)
