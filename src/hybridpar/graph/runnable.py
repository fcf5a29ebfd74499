"""The graph a model-parallel runtime executes node by node: torch.fx's symbolic trace, or, for a model
fx cannot trace (Hugging Face GPT-2's mask helpers, Python branches on shapes), torch.export's graph at
the example inputs' shapes.

Why export as the fallback: the placer already prices such models on torch.export's graph
(graph.tracing), so running the same graph executes what was priced. Its graph is the model's ATen
ops with the parameters read by `get_attr` under their own names (`ep.module()`), and the
`nn_module_stack` of every node, so a placement by module name places it. What it costs: the graph is
specialised to the example's shapes (the batch a replica runs), and the devices the export saw
(`device=cpu` on `arange`, `zeros`, ... and `_assert_tensor_metadata` checks) are rewritten by the
executor to the device it runs on (`EXPORTED` marks such a graph).
"""

from __future__ import annotations

import contextlib
import io
import warnings

import torch
from torch import fx, nn

from hybridpar.errors import UserError

EXPORTED = "hybridpar_exported"  # attribute set on a GraphModule that came from torch.export

# Checks torch.export leaves in its graph, specialised to the device and dtypes it traced with.
_CHECKS = ("_assert_tensor_metadata", "_assert_scalar", "_assert_async", "sym_constrain_range")


def runnable_graph(module: nn.Module, example_inputs: tuple | None = None) -> fx.GraphModule:
    """`module` as an fx.GraphModule: torch.fx's trace (shape-independent; it shares `module`'s
    submodules), else torch.export's at the shapes of `example_inputs` (its parameters are
    `module`'s own tensor objects). A UserError names both failures when neither traces."""
    try:
        return _symbolic_trace(module)
    except Exception as fx_err:  # noqa: BLE001 - fx raises many types on untraceable code
        first = _short(fx_err)
        if example_inputs is None:
            raise UserError(f"model parallelism needs a torch.fx-traceable model: {first}") from None
    try:
        # export's warnings, and the graph it prints to stderr when it fails, are not the user's business
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            gm = torch.export.export(module, tuple(example_inputs), strict=False).module()
    except Exception as ex_err:  # noqa: BLE001 - a user's model can raise anything
        raise UserError(f"model parallelism needs a torch.fx-traceable or torch.export-able model: "
                        f"torch.fx: {first}; torch.export: {_short(ex_err)}") from None
    for node in list(gm.graph.nodes):
        name = getattr(node.target, "__name__", str(node.target))
        check = (node.op == "call_module" and str(node.target) == "_guards_fn") or (
            node.op == "call_function" and any(c in name for c in _CHECKS))
        if check and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    setattr(gm, EXPORTED, True)
    return gm


class _Tracer(fx.Tracer):
    """torch.fx's tracer, with every batch norm a leaf (call_module), a user's subclass included: the
    runtime swaps such modules for ones with global-batch statistics, which a traced-through subclass
    (its F.batch_norm inlined in the graph) would escape."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, nn.modules.batchnorm._BatchNorm) or super().is_leaf_module(m, module_qualified_name)


def _symbolic_trace(module: nn.Module) -> fx.GraphModule:
    """fx.symbolic_trace(module) with batch norms as leaves (_Tracer)."""
    tracer = _Tracer()
    graph = tracer.trace(module)
    return fx.GraphModule(tracer.root, graph, module.__class__.__name__)


def is_exported(gm: fx.GraphModule) -> bool:
    return bool(getattr(gm, EXPORTED, False))


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:160] if text else ''}"
