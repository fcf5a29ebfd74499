"""Trace an nn.Module into a `Graph`: torch.fx symbolic trace + ShapeProp, torch.export as fallback.

Both tracers produce per-op records (`OpRecord`, in graph/ops.py); `build_graph` then folds shape-only
ops away (keeping the DAG connected through them), attributes each parameter once to the op that first
consumes it, propagates which activations need gradients, and computes FLOPs (graph/flops.py).
Trainable parameters that no traced op reads (e.g. a mask token used only for masked inputs) are still
gradients the runtime sends: they are attributed to the first node of their module (Graph meta
`free_params` lists them). An op without a FLOP rule, or a leaf module whose FLOPs cannot be measured,
is a UserError naming it, never a silent zero.
Works on the `meta` device, so models with billions of parameters trace without allocating weights.

The model is traced in the mode asked for (`train=True`/`False`; None keeps the module's own mode)
and at the batch of the example inputs, so callers trace at the batch the user asks for. One
exception: at batch 1, batch-norm layers trace in eval mode, since in training mode PyTorch refuses a
batch of one value per channel (batch 1 after global pooling) and its meta kernel divides by n - 1;
their output shapes, parameters and FLOPs are the same in either mode. Every other module keeps the
mode asked for (dropout, training-only branches such as Inception's aux head).
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
from hybridpar.graph.ops import _MEASURED_KINDS, OpRecord, UnpricedOp, classify, is_opaque, nhwc_strided, shape_of
from hybridpar.graph.types import NHWC_IN, Graph

MEASURED = "hybridpar_measured_flops"
UNMEASURED = "hybridpar_unmeasured"


def trace(module: nn.Module, example_inputs, name: str | None = None, *, train: bool | None = None) -> Graph:
    """Graph of `module` run on `example_inputs` (a tensor or a tuple of tensors), in training mode
    (`train=True`), eval mode (`False`) or each module's current mode (None)."""
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    name = name or type(module).__name__
    batch = _batch_of(inputs)
    training = train if train is not None else module.training
    with _mode(module, train, batch):
        try:
            (records, outputs), tracer = _fx_records(module, inputs), "torch.fx"
            if any(r.attrs.get("flops_source") == "flop_counter" for r in records):
                # torch.fx kept a torch.nn module we have no rule for (nn.TransformerEncoderLayer,
                # nn.MultiheadAttention, ...) as one measured node; torch.export splits it into ops with
                # their own shapes, parameters and activations. Keep the measured node if export fails.
                with contextlib.suppress(Exception):
                    (records, outputs), tracer = _export_records(module, inputs), "torch.export"
        except Exception as fx_err:  # noqa: BLE001 -- fx rejects Python control flow and more; try export
            try:
                (records, outputs), tracer = _export_records(module, inputs), "torch.export"
            except Exception as ex_err:  # noqa: BLE001 -- a user's model can raise anything
                unpriced = next((e for e in (ex_err, fx_err) if isinstance(e, UnpricedOp)), None)
                if unpriced is not None:
                    raise UserError(f"model {name!r}: cannot price {unpriced}: hybridpar has no FLOP rule for "
                                    "it (graph/ops.py)") from None
                raise UserError(f"cannot trace model {name!r}: torch.fx: {_short(fx_err)}; "
                                f"torch.export: {_short(ex_err)}") from None
    trainable = tuple((n, tuple(p.shape), id(p)) for n, p in module.named_parameters() if p.requires_grad)
    classes = {n: f"{type(m).__module__}.{type(m).__qualname__}" for n, m in module.named_modules()}
    return build_graph(name, records, batch=batch, free_params=trainable, outputs=outputs,
                       meta=(("tracer", tracer), ("train", training)), module_classes=classes)


@contextlib.contextmanager
def _mode(module: nn.Module, train: bool | None, batch: int):
    modes = {m: m.training for m in module.modules()}
    if train is not None:
        module.train(train)
    if batch == 1:  # see the module docstring
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.training = False
    try:
        yield
    finally:
        for m, t in modes.items():
            m.training = t


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


# Example inputs may be meta tensors (plan, place, inspect: shapes only, so an --input-shape of any
# size costs nothing). A module with real weights that the meta path cannot run needs real inputs:
# made here, within a limit, instead of the caller allocating them up front.
MAX_REAL_INPUT_BYTES = 1 << 30


def real_inputs(module: nn.Module, inputs: tuple) -> tuple:
    """`inputs` with meta tensors made real (seeded normal floats, zero integers) when `module` has real
    weights; UserError when they would exceed MAX_REAL_INPUT_BYTES."""
    if not any(isinstance(x, torch.Tensor) and x.is_meta for x in inputs):
        return inputs
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        return inputs  # a meta module runs meta inputs
    size = sum(x.numel() * x.element_size() for x in inputs if isinstance(x, torch.Tensor) and x.is_meta)
    if size > MAX_REAL_INPUT_BYTES:
        raise UserError(f"tracing this model needs real example inputs of {size:,} bytes (over "
                        f"{MAX_REAL_INPUT_BYTES:,}): give a smaller --input-shape")
    g = torch.Generator().manual_seed(0)

    def real(x):
        if not (isinstance(x, torch.Tensor) and x.is_meta):
            return x
        if x.dtype.is_floating_point:
            return torch.randn(x.shape, generator=g, dtype=x.dtype)
        return torch.zeros(x.shape, dtype=x.dtype)

    return tuple(real(x) for x in inputs)


# --- torch.fx -------------------------------------------------------------------------------------

def _fx_records(module: nn.Module, inputs: tuple) -> tuple[list[OpRecord], tuple[str, ...]]:
    gm = symbolic_trace(module)
    _propagate_shapes(gm, inputs)
    records = [r for n in gm.graph.nodes if (r := _fx_record(gm, n)) is not None]
    outputs = tuple(a.name for n in gm.graph.nodes if n.op == "output" for a in _arg_nodes(n))
    return records, outputs


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


class _ShapePropRun(nn.Module):
    """Runs ShapeProp inside functional_call, so the graph module sees swapped-in meta weights."""

    def __init__(self, gm: GraphModule):
        super().__init__()
        self.gm = gm

    def forward(self, *args):
        return _MetaShapeProp(self.gm).propagate(*args)


class _MeasuringShapeProp(ShapeProp):
    """ShapeProp that measures each opaque leaf module (graph/measured.py) on the arguments it gets."""

    def run_node(self, n):
        if n.op == "call_module" and is_opaque(self.fetch_attr(n.target)):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            try:
                n.meta[MEASURED] = measure_module(self.fetch_attr(n.target), args, kwargs)
                n.meta.pop(UNMEASURED, None)
            except Exception as err:  # noqa: BLE001 -- reported by name when the node is built
                n.meta.pop(MEASURED, None)
                n.meta[UNMEASURED] = _short(err)
        return super().run_node(n)


class _MetaShapeProp(_MeasuringShapeProp):
    """ShapeProp that gives nn.LSTM's output shapes directly: on meta its kernel decomposes into
    Python-dispatched per-step ops (seconds for GNMT) for shapes that follow from its attributes."""

    def call_module(self, target, args, kwargs):
        mod = self.fetch_attr(target)
        if isinstance(mod, nn.LSTM) and len(args) == 1 and not kwargs and args[0].is_meta:
            return _lstm_outputs(mod, args[0])
        return super().call_module(target, args, kwargs)


def _lstm_outputs(lstm: nn.LSTM, x: torch.Tensor):
    dirs = 2 if lstm.bidirectional else 1
    width = lstm.proj_size or lstm.hidden_size
    out = x.new_empty((*x.shape[:-1], dirs * width))
    layers = lstm.num_layers * dirs
    lead = (layers,) if x.dim() == 2 else (layers, x.shape[0 if lstm.batch_first else 1])
    return out, (x.new_empty((*lead, width)), x.new_empty((*lead, lstm.hidden_size)))


def _propagate_shapes(gm: GraphModule, inputs: tuple) -> None:
    # Shapes on the meta device: no arithmetic and no weight copies, so big real models trace fast.
    # Modules that build CPU tensors inside forward cannot mix with meta; run those for real.
    # ShapeProp prints a traceback before re-raising; errors reach the user as one line instead.
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            _propagate_on_meta(gm, inputs)
        except Exception:  # noqa: BLE001 -- any meta failure: retry with the real tensors
            _MeasuringShapeProp(gm).propagate(*real_inputs(gm, inputs))


def _propagate_on_meta(gm: GraphModule, inputs: tuple) -> None:
    state = {f"gm.{k}": _to_meta(v) for k, v in (*gm.named_parameters(), *gm.named_buffers())}
    meta_inputs = tuple(_to_meta(x) if isinstance(x, torch.Tensor) else x for x in inputs)
    torch.func.functional_call(_ShapePropRun(gm), state, meta_inputs)


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
        if is_opaque(mod):
            if MEASURED not in node.meta:
                why = node.meta.get(UNMEASURED, "it was not run")
                raise UnpricedOp(f"module {node.target!r} ({type(mod).__name__}): its FLOPs could not be "
                                 f"measured ({why})")
            kind = _MEASURED_KINDS.get(type(mod).__name__.lower(), "other")
            attrs = {"flops_source": "flop_counter", "measured": node.meta[MEASURED], "module_type": type(mod).__name__}
        else:
            kind, attrs = _classify(type(mod).__name__.lower(), mod, node.args, node.kwargs, in_shapes, out,
                                    node.target)
        params = [(f"{node.target}.{k}", p) for k, p in mod.named_parameters()]
        attrs = _with_format(kind, attrs, args[0].meta.get("tensor_meta") if args else None)
        return OpRecord(node.name, kind, tuple(a.name for a in args), in_shapes, out, module=node.target,
                        scope=node.target, params=_param_tuples(params), attrs=attrs)
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    kind, attrs = _classify(target, None, node.args, node.kwargs, in_shapes, out, scope)
    attrs = _with_format(kind, attrs, args[0].meta.get("tensor_meta") if args else None)
    return OpRecord(node.name, kind, tuple(a.name for a in args), in_shapes, out, scope=scope, attrs=attrs)


def _with_format(kind: str, attrs: dict, meta) -> dict:
    """`attrs` with NHWC_IN where the op's first input arrives in channels-last strides."""
    return {**attrs, NHWC_IN: True} if nhwc_strided(kind, meta) else attrs


def _classify(op_name, mod, args, kwargs, in_shapes, out, where):
    try:
        return classify(op_name, mod, args, kwargs, in_shapes, out)
    except UnpricedOp as err:
        raise UnpricedOp(f"op {str(err)!r} in module {where or '(top level)'!r}") from None


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

def _export_records(module: nn.Module, inputs: tuple) -> tuple[list[OpRecord], tuple[str, ...]]:
    with warnings.catch_warnings():  # export's internal warnings are not the user's business
        warnings.simplefilter("ignore")
        ep = torch.export.export(module, real_inputs(module, inputs), strict=False)
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
        kind, attrs = _classify(op_name, mod, node.args, node.kwargs, in_shapes, out, scope)
        attrs = _with_format(kind, attrs, args[0].meta.get("val") if args else None)
        leaf = mod is not None and scope and not any(True for _ in mod.children())
        records.append(OpRecord(node.name, kind, tuple(a.name for a in args), in_shapes, out,
                                module=scope if leaf and kind not in ("fold", "other") else None,
                                scope=scope or None, attrs=attrs))
    return records, tuple(str(o) for o in sig.user_outputs)
