"""Turn tracer op records into a `Graph`: fold shape-only ops, attribute parameters, compute FLOPs."""

from __future__ import annotations

from typing import Any

from hybridpar.graph.flops import node_flops
from hybridpar.graph.ops import OpRecord, ParamRef
from hybridpar.graph.types import Graph, Node


def build_graph(name: str, records: list[OpRecord], *, batch: int = 1,
                meta: tuple[tuple[str, Any], ...] = ()) -> Graph:
    reps: dict[str, tuple[str, ...]] = {}  # record -> graph nodes its value stands for
    carry: dict[str, tuple[ParamRef, ...]] = {}  # record -> parameters not yet given to a node
    needs_grad: dict[str, bool] = {}
    seen_params: set[int] = set()
    nodes: list[Node] = []
    for r in records:
        if r.is_input:
            reps[r.name], carry[r.name], needs_grad[r.name] = (r.name,), (), False
            nodes.append(Node(r.name, "input", out_shape=r.out_shape or ()))
            continue
        data_args = [(a, s) for a, s in zip(r.args, r.in_shapes) if reps.get(a)]
        data_inputs = tuple(dict.fromkeys(x for a, _ in data_args for x in reps[a]))
        params = r.params + tuple(p for a in r.args for p in carry.get(a, ()))
        if r.kind == "fold" or not data_inputs:
            # Shape-only op, or one computing only on parameters/constants (e.g. a weight
            # normalisation): stands for its data inputs; its parameters pass to the consumer.
            reps[r.name], carry[r.name] = data_inputs, params
            continue
        new_params = _first_use(params, seen_params)
        kind, attrs = _refine(r, params, len(data_args))
        input_grads = [any(needs_grad[x] for x in reps[a]) for a, _ in data_args]
        has_weight = bool(params)
        in_shapes = tuple(s or () for _, s in data_args)
        f = node_flops(kind, in_shapes, r.out_shape, attrs, input_grads, has_weight)
        attrs = dict(attrs)
        measured = attrs.pop("measured", None)
        if measured is not None:  # an opaque module's FlopCounterMode figures
            f = type(f)(measured.fwd, measured.bwd_data if any(input_grads) else 0, measured.bwd_weight)
        needs_grad[r.name] = any(input_grads) or has_weight
        reps[r.name], carry[r.name] = (r.name,), ()
        attrs = {**attrs, "scope": r.scope}
        nodes.append(Node(r.name, kind, data_inputs, in_shapes, r.out_shape, r.module,
                          tuple((n, s) for n, s, _ in new_params), f.fwd, f.bwd_data, f.bwd_weight,
                          tuple(attrs.items())))
    return Graph(name, tuple(nodes), batch=batch, meta=meta)


def _first_use(params: tuple[ParamRef, ...], seen: set[int]) -> list[ParamRef]:
    """Parameters counted on the first op that uses them (shared/tied weights count once)."""
    out = []
    for p in params:
        if p[2] not in seen:
            seen.add(p[2])
            out.append(p)
    return out


def _refine(r: OpRecord, params: tuple[ParamRef, ...], n_data: int) -> tuple[str, dict]:
    # A matmul of one activation with a 2-D weight is a linear layer, whatever spelling it had.
    if r.kind == "attention" and n_data == 1 and params and len(params[0][1]) == 2:
        w = params[0][1]
        k = r.attrs.get("k")
        out_f = w[1] if w[0] == k else w[0]
        return "linear", {"in_features": k, "out_features": out_f, "bias": len(params) > 1}
    return r.kind, r.attrs
