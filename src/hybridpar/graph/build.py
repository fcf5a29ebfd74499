"""Turn tracer op records into a `Graph`: fold shape-only ops, attribute parameters, compute FLOPs."""

from __future__ import annotations

from typing import Any

from hybridpar.graph.flops import MATMUL_OPS, Flops, node_flops
from hybridpar.graph.ops import OpRecord, ParamRef
from hybridpar.graph.types import Graph, Node


def build_graph(name: str, records: list[OpRecord], *, batch: int = 1,
                meta: tuple[tuple[str, Any], ...] = (), free_params: tuple[ParamRef, ...] = (),
                outputs: tuple[str, ...] | None = None, module_classes: dict[str, str] | None = None) -> Graph:
    """`free_params`: the module's trainable parameters; those no node was given (no op reads them)
    are attributed to the first node of the innermost module that owns them (else the first node)
    and listed in meta `free_params`. `outputs`: the records the model returns; nodes none of them
    depends on (a pooler whose result is dropped) run forward but get no backward. `module_classes`:
    module name -> its exact class ("torch.nn.modules.linear.Linear"), recorded on conv2d/linear nodes
    as attr `module_class` ("" for a functional op such as F.linear inside nn.MultiheadAttention): the
    runtime replaces only exact nn.Linear/nn.Conv2d modules by distributed layers
    (hybridpar.cost.layout_comm.splits_by_layout)."""
    reps: dict[str, tuple[str, ...]] = {}  # record -> graph nodes its value stands for
    carry: dict[str, tuple[ParamRef, ...]] = {}  # record -> parameters not yet given to a node
    # record -> parameter-only ops upstream of it: op -> (FLOPs, matmul-class FLOPs), not yet given
    branch: dict[str, dict[str, tuple[Flops, Flops]]] = {}
    given: set[str] = set()
    is_param: set[str] = set()
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
        upstream = {k: v for a in dict.fromkeys(r.args) for k, v in branch.get(a, {}).items() if k not in given}
        if r.kind == "fold" or not data_inputs:
            # Shape-only op, or one computing only on parameters/constants (a weight normalisation, a
            # learned query projected every step, a position-bias MLP on a constant table): stands for
            # its data inputs; its parameters, and the FLOPs it does, pass to the consumer.
            if r.kind == "fold" and r.params and not r.args:
                is_param.add(r.name)
            if r.kind != "fold":
                weights = {a for a in r.args if a in is_param or (carry.get(a) and not branch.get(a))}
                upstream[r.name] = _param_only_flops(r, params, carry, weights)
            reps[r.name], carry[r.name], branch[r.name] = data_inputs, params, upstream
            continue
        new_params = _first_use(params, seen_params)
        weights = {a for a in r.args if not reps.get(a) and carry.get(a) and not branch.get(a)}
        kind, attrs = _refine(r, params, len(data_args), weights)
        input_grads = [any(needs_grad[x] for x in reps[a]) for a, _ in data_args]
        has_weight = bool(params)
        in_shapes = tuple(s or () for _, s in data_args)
        attrs = dict(attrs)
        if data_args and not any(input_grads):
            # on the model's inputs alone: autograd computes no gradient of this op's input, whatever
            # its FLOP rule says (a Conv3d stem, a pooling of the image); cost.compute prices no dx
            attrs["input_grad"] = False
        measured = attrs.pop("measured", None)
        if measured is not None:  # an opaque module's FlopCounterMode figures
            f = Flops(measured.fwd, measured.bwd_data if any(input_grads) else 0, measured.bwd_weight)
        elif kind == "attention":
            f = _product_flops(r, attrs, lambda a: any(needs_grad[x] for x in reps.get(a, ())), carry)
        else:
            f = node_flops(kind, in_shapes, r.out_shape, attrs, input_grads, has_weight)
        if upstream:
            given.update(upstream)
            total, mm = _sum(v[0] for v in upstream.values()), _sum(v[1] for v in upstream.values())
            f = _sum((f, total))
            attrs["branch_flops"] = (total.fwd, total.bwd_data, total.bwd_weight)
            attrs["branch_matmul_flops"] = (mm.fwd, mm.bwd_data, mm.bwd_weight)
        needs_grad[r.name] = any(input_grads) or has_weight
        reps[r.name], carry[r.name], branch[r.name] = (r.name,), (), {}
        attrs = {**attrs, "scope": r.scope}
        # "": a functional op (F.linear, F.interpolate); an upsampling's class decides its spatial runtime
        if (kind in ("conv2d", "linear") or "upsample_mode" in attrs) and module_classes is not None:
            attrs["module_class"] = module_classes.get(r.module, "") if r.module else ""
        nodes.append(Node(r.name, kind, data_inputs, in_shapes, r.out_shape, r.module,
                          tuple((n, s) for n, s, _ in new_params), f.fwd, f.bwd_data, f.bwd_weight,
                          tuple(attrs.items())))
    if outputs is not None:
        nodes = _without_dead_backward(nodes, {x for o in outputs for x in reps.get(o, ())})
    free = [p for p in free_params if p[2] not in seen_params]
    if free:
        nodes = _attach(nodes, free)
        meta = (*meta, ("free_params", tuple(p[0] for p in free)))
    return Graph(name, tuple(nodes), batch=batch, meta=meta)


def _attach(nodes: list[Node], free: list[ParamRef]) -> list[Node]:
    import dataclasses

    work = [i for i, n in enumerate(nodes) if n.op != "input"] or list(range(len(nodes)))
    extra: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    for pname, shape, _ in free:
        owner = pname.rpartition(".")[0]
        target = None
        while target is None:
            target = next((i for i in work if _within(nodes[i], owner)), None)
            if not owner:
                break
            owner = owner.rpartition(".")[0]
        extra.setdefault(work[0] if target is None else target, []).append((pname, shape))
    return [dataclasses.replace(n, param_shapes=n.param_shapes + tuple(extra[i]),
                                attrs=n.attrs + (("free_params", tuple(p for p, _ in extra[i])),))
            if i in extra else n for i, n in enumerate(nodes)]


def _within(node: Node, owner: str) -> bool:
    if not owner:
        return True
    for where in (node.module, node.attr("scope")):
        if where and (where == owner or where.startswith(owner + ".")):
            return True
    return False


def _without_dead_backward(nodes: list[Node], live: set[str]) -> list[Node]:
    import dataclasses

    for n in reversed(nodes):
        if n.name in live:
            live.update(n.inputs)
    def dead(n: Node) -> Node:
        attrs = tuple((k, (v[0], 0, 0) if k in ("branch_flops", "branch_matmul_flops") else v) for k, v in n.attrs)
        return dataclasses.replace(n, bwd_data_flops=0, bwd_weight_flops=0, attrs=attrs + (("dead_end", True),))

    return [n if n.name in live or n.op == "input" else dead(n) for n in nodes]


def _product_flops(r: OpRecord, attrs: dict, data_grad, carry) -> Flops:
    """An activation product (matmul, bmm, baddbmm, einsum, SDPA): each tensor operand gets a gradient
    when it depends on data that needs one (backward-data) or on parameters (backward-weight: a learned
    query, a weight used through matmul). An operand that is both counts once, as backward-data."""
    operands = [a for a, s in zip(r.args, r.in_shapes) if s]
    shapes = tuple(s for s in r.in_shapes if s)
    if attrs.get("sdpa"):  # q, k, v; a mask's gradient is the scores' gradient, no product of its own
        operands, shapes = operands[:3], shapes[:3]
    data = [data_grad(a) for a in operands]
    weight = [bool(carry.get(a)) and not d for a, d in zip(operands, data)]
    fwd = node_flops("attention", shapes, r.out_shape, attrs, data, False)
    w = node_flops("attention", shapes, r.out_shape, attrs, weight, False)
    return Flops(fwd.fwd, fwd.bwd_data, w.bwd_data)


def _sum(flops) -> Flops:
    out = Flops()
    for f in flops:
        out = Flops(out.fwd + f.fwd, out.bwd_data + f.bwd_data, out.bwd_weight + f.bwd_weight)
    return out


def _param_only_flops(r: OpRecord, params, carry, weights: set[str]) -> tuple[Flops, Flops]:
    """(FLOPs, matmul-class FLOPs) of an op whose operands are parameters, buffers or constants. Its
    operands that are parameters as stored (or views of them) are its weights; the others need a
    gradient when they were computed from parameters."""
    if r.kind in ("linear", "conv2d", "conv", "batchnorm", "layernorm") and r.args:
        weights = set(r.args[1:]) - {r.args[0]}  # F.linear(x, w, b) and the like: x is the operand
    others = [(a, s) for a, s in zip(r.args, r.in_shapes) if a not in weights]
    kind, attrs = _refine(r, params, len(others), weights)
    grads = [bool(carry.get(a)) for a, _ in others]
    has_weight = bool(r.params) or any(a in weights for a in r.args)
    measured = attrs.get("measured")
    if measured is not None:
        f = Flops(measured.fwd, measured.bwd_data if any(grads) else 0, measured.bwd_weight)
    else:
        f = node_flops(kind, tuple(s or () for _, s in others), r.out_shape or (), attrs, grads, has_weight)
    return f, (f if kind in MATMUL_OPS or measured is not None else Flops())


def _first_use(params: tuple[ParamRef, ...], seen: set[int]) -> list[ParamRef]:
    """Parameters counted on the first op that uses them (shared/tied weights count once)."""
    out = []
    for p in params:
        if p[2] not in seen:
            seen.add(p[2])
            out.append(p)
    return out


def _refine(r: OpRecord, params: tuple[ParamRef, ...], n_data: int, weight_args=None) -> tuple[str, dict]:
    """A matmul of one activation with a 2-D weight is a linear layer, whatever spelling it had. The
    weight is an operand that is a parameter as stored (or a view of it), not a value computed from
    parameters (a learned query projected first is an activation of the attention)."""
    if r.kind != "attention" or n_data != 1 or not params or "flops" in r.attrs:
        return r.kind, r.attrs
    shapes = [s for a, s in zip(r.args, r.in_shapes) if weight_args is None or a in weight_args]
    stored = {tuple(p[1]) for p in params}
    w = next((tuple(s) for s in shapes if s and len(s) == 2 and (tuple(s) in stored or tuple(s[::-1]) in stored)),
             None)
    if w is None:
        return r.kind, r.attrs
    k = r.attrs.get("k")
    out_f = w[1] if w[0] == k else w[0]
    return "linear", {"in_features": k, "out_features": out_f, "bias": len(params) > 1}
