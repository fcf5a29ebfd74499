"""Trace an nn.Module into a `Graph`: torch.fx symbolic trace + ShapeProp, torch.export as fallback.

Both tracers produce per-op records (`OpRecord`, in graph/ops.py); `build_graph` then folds shape-only
ops away (keeping the DAG connected through them), attributes each parameter once to the op that first
consumes it, propagates which activations need gradients, and computes FLOPs (graph/flops.py).
Works on the `meta` device, so models with billions of parameters trace without allocating weights.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import torch
from torch import nn
from torch.fx import GraphModule, symbolic_trace
from torch.fx.passes.shape_prop import ShapeProp

from hybridpar.errors import UserError
from hybridpar.graph.build import build_graph
from hybridpar.graph.measured import measure_module
from hybridpar.graph.ops import OpRecord, classify, is_opaque, shape_of
from hybridpar.graph.types import Graph

MEASURED = "hybridpar_measured_flops"


def trace(module: nn.Module, example_inputs, name: str | None = None) -> Graph:
    """Graph of `module` run on `example_inputs` (a tensor or a tuple of tensors)."""
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    name = name or type(module).__name__
    try:
        records, tracer = _fx_records(module, inputs), "torch.fx"
    except Exception as fx_err:  # noqa: BLE001 -- fx rejects Python control flow and more; try export
        try:
            records, tracer = _export_records(module, inputs), "torch.export"
        except Exception as ex_err:  # noqa: BLE001 -- a user's model can raise anything
            raise UserError(f"cannot trace model {name!r}: torch.fx: {_short(fx_err)}; "
                            f"torch.export: {_short(ex_err)}") from None
    batch = _batch_of(inputs)
    return build_graph(name, records, batch=batch, meta=(("tracer", tracer),))


def _short(err: BaseException) -> str:
    while err.__cause__ is not None:  # ShapeProp wraps the model's own error: report that one
        err = err.__cause__
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:200]}"


def _batch_of(inputs: tuple) -> int:
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    return 1


# --- torch.fx -------------------------------------------------------------------------------------

def _fx_records(module: nn.Module, inputs: tuple) -> list[OpRecord]:
    gm = symbolic_trace(module)
    _propagate_shapes(gm, inputs)
    return [r for n in gm.graph.nodes if (r := _fx_record(gm, n)) is not None]


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


class _ShapePropRun(nn.Module):
    """Runs ShapeProp inside functional_call, so the graph module sees swapped-in meta weights."""

    def __init__(self, gm: GraphModule):
        super().__init__()
        self.gm = gm

    def forward(self, *args):
        return _MetaShapeProp(self.gm).propagate(*args)


class _MetaShapeProp(ShapeProp):
    """ShapeProp that gives nn.LSTM's output shapes directly: on meta its kernel decomposes into
    Python-dispatched per-step ops (seconds for GNMT) for shapes that follow from its attributes."""

    def call_module(self, target, args, kwargs):
        mod = self.fetch_attr(target)
        if isinstance(mod, nn.LSTM) and len(args) == 1 and not kwargs and args[0].is_meta:
            return _lstm_outputs(mod, args[0])
        return super().call_module(target, args, kwargs)

    def run_node(self, n):
        if n.op == "call_module" and is_opaque(self.fetch_attr(n.target)):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            try:
                n.meta[MEASURED] = measure_module(self.fetch_attr(n.target), args, kwargs)
            except Exception:  # noqa: BLE001 -- no measurement: the node keeps 0 FLOPs
                n.meta.pop(MEASURED, None)
        return super().run_node(n)


def _lstm_outputs(lstm: nn.LSTM, x: torch.Tensor):
    dirs = 2 if lstm.bidirectional else 1
    width = lstm.proj_size or lstm.hidden_size
    out = x.new_empty((*x.shape[:-1], dirs * width))
    lead = (lstm.num_layers * dirs,) if x.dim() == 2 else (lstm.num_layers * dirs, x.shape[0 if lstm.batch_first else 1])
    return out, (x.new_empty((*lead, width)), x.new_empty((*lead, lstm.hidden_size)))


def _propagate_shapes(gm: GraphModule, inputs: tuple) -> None:
    # Shapes on the meta device: no arithmetic and no weight copies, so big real models trace fast.
    # Modules that build CPU tensors inside forward cannot mix with meta; run those for real.
    # ShapeProp prints a traceback before re-raising; errors reach the user as one line instead.
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            _propagate_on_meta(gm, inputs)
        except Exception:  # noqa: BLE001 -- any meta failure: retry with the real tensors
            ShapeProp(gm).propagate(*inputs)


def _propagate_on_meta(gm: GraphModule, inputs: tuple) -> None:
    state = {f"gm.{k}": _to_meta(v) for k, v in (*gm.named_parameters(), *gm.named_buffers())}
    meta_inputs = tuple(_to_meta(x) if isinstance(x, torch.Tensor) else x for x in inputs)
    with _batchnorm_in_eval(gm):
        torch.func.functional_call(_ShapePropRun(gm), state, meta_inputs)


@contextlib.contextmanager
def _batchnorm_in_eval(module: nn.Module):
    """Training-mode BN refuses one value per channel (batch 1 after global pooling, as in Inception's
    aux head); BN's output shape is the same in either mode, and the rest of the model keeps its mode
    (training-only branches such as that aux head are still traced)."""
    bns = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    for m in bns:
        m.training = False
    try:
        yield
    finally:
        for m in bns:
            m.training = True


def _fx_record(gm: GraphModule, node: torch.fx.Node) -> OpRecord | None:
    if node.op == "output":
        return None
    out = shape_of(node.meta.get("tensor_meta"))
    if node.op == "placeholder":
        return OpRecord(node.name, "input", (), (), out, is_input=True)
    if node.op == "get_attr":
        value = _fetch(gm, node.target)
        params = _param_list(node.target, value)
        return OpRecord(node.name, "fold", (), (), out, params=params)
    args = _arg_nodes(node)
    in_shapes = tuple(shape_of(a.meta.get("tensor_meta")) for a in args)
    stack = node.meta.get("nn_module_stack") or {}
    scope = list(stack.values())[-1][0] if stack else None
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        kind, attrs = classify(type(mod).__name__.lower(), mod, node.args, node.kwargs, in_shapes, out)
        if MEASURED in node.meta:
            attrs = {**attrs, "flops_source": "flop_counter", "measured": node.meta[MEASURED]}
        params = [(f"{node.target}.{k}", p) for k, p in mod.named_parameters()]
        return OpRecord(node.name, kind, tuple(a.name for a in args), in_shapes, out, module=node.target,
                        scope=node.target, params=_param_tuples(params), attrs=attrs)
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    kind, attrs = classify(target, None, node.args, node.kwargs, in_shapes, out)
    return OpRecord(node.name, kind, tuple(a.name for a in args), in_shapes, out, scope=scope, attrs=attrs)


def _fetch(gm: GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _param_list(qualname: str, value) -> tuple:
    if isinstance(value, nn.Parameter) and value.requires_grad:
        return ((qualname, tuple(value.shape), id(value)),)
    return ()


def _param_tuples(named) -> tuple:
    return tuple((n, tuple(p.shape), id(p)) for n, p in named if p.requires_grad)


def _arg_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(a) or a)
    return list(dict.fromkeys(found))


# --- torch.export ---------------------------------------------------------------------------------

def _export_records(module: nn.Module, inputs: tuple) -> list[OpRecord]:
    with warnings.catch_warnings():  # export's internal warnings are not the user's business
        warnings.simplefilter("ignore")
        ep = torch.export.export(module, inputs, strict=False)
    sig = ep.graph_signature
    param_of = {ph: fqn for ph, fqn in sig.inputs_to_parameters.items()}
    user_inputs = set(sig.user_inputs)
    records = []
    for node in ep.graph.nodes:
        if node.op == "output":
            continue
        out = shape_of(node.meta.get("val"))
        if node.op == "placeholder":
            if node.name in param_of:
                p = module.get_parameter(param_of[node.name])
                records.append(OpRecord(node.name, "fold", (), (), out,
                                        params=_param_list(param_of[node.name], p)))
            elif node.name in user_inputs:
                records.append(OpRecord(node.name, "input", (), (), out, is_input=True))
            else:  # buffers and constants carry no data dependency
                records.append(OpRecord(node.name, "fold", (), (), None))
            continue
        args = _arg_nodes(node)
        in_shapes = tuple(shape_of(a.meta.get("val")) for a in args)
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        scope = stack[-1][0] if stack else None
        mod = module.get_submodule(scope) if scope else None
        target = node.target
        op_name = target.overloadpacket.__name__ if hasattr(target, "overloadpacket") else getattr(
            target, "__name__", str(target))
        kind, attrs = classify(op_name, mod, node.args, node.kwargs, in_shapes, out)
        leaf = mod is not None and scope and not any(True for _ in mod.children())
        records.append(OpRecord(node.name, kind, tuple(a.name for a in args), in_shapes, out,
                                module=scope if leaf and kind not in ("fold", "other") else None,
                                scope=scope or None, attrs=attrs))
    return records
