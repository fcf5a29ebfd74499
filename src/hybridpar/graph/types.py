"""The planner's view of a model: a DAG of operator nodes with shapes, parameters, FLOPs and bytes."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from math import prod
from typing import Any

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2}

# A node attribute: the model's own forward hands this image op (a convolution, pooling or batch norm)
# its input in channels-last strides (graph.ops.nhwc_strided), so a plain run's time for it is the
# channels-last record's (cost.compute.op_time; profile.ops.model_nhwc_variants times it)
NHWC_IN = "nhwc_in"

# Op kinds the rest of the pipeline understands; anything else is "other".
OP_KINDS = (
    "input", "conv2d", "linear", "batchnorm", "layernorm", "relu", "pointwise", "maxpool", "avgpool",
    "adaptive_avgpool", "add", "mul", "concat", "flatten", "reshape", "dropout", "lstm", "embedding",
    "attention", "softmax", "loss", "output", "conv", "reduce", "other",
)


@dataclass(frozen=True)
class Node:
    """One operator. `module` is the qualified nn.Module name it came from (None for functionals),
    so that a plan keyed by node maps back to the module the runtime replaces."""

    name: str
    op: str
    inputs: tuple[str, ...] = ()
    in_shapes: tuple[tuple[int, ...], ...] = ()
    out_shape: tuple[int, ...] = ()
    module: str | None = None
    param_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    fwd_flops: int = 0
    bwd_data_flops: int = 0
    bwd_weight_flops: int = 0
    attrs: tuple[tuple[str, Any], ...] = ()

    @property
    def params(self) -> int:
        return sum(prod(s) for _, s in self.param_shapes)

    @property
    def bwd_flops(self) -> int:
        return self.bwd_data_flops + self.bwd_weight_flops

    @property
    def out_numel(self) -> int:
        return prod(self.out_shape) if self.out_shape else 0

    def attr(self, key: str, default: Any = None) -> Any:
        return dict(self.attrs).get(key, default)

    def out_bytes(self, dtype: str = "fp32") -> int:
        return self.out_numel * DTYPE_BYTES[dtype]

    def param_bytes(self, dtype: str = "fp32") -> int:
        return self.params * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class Graph:
    """Nodes in topological order. Edges are each node's `inputs`."""

    name: str
    nodes: tuple[Node, ...]
    batch: int = 1
    meta: tuple[tuple[str, Any], ...] = field(default=())

    @cached_property
    def by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    def node(self, name: str) -> Node:
        return self.by_name[name]

    @cached_property
    def successors(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.name)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def outputs(self) -> tuple[str, ...]:
        """The nodes no other node reads: what the model returns (tracing drops dead ends)."""
        return tuple(k for k, v in self.successors.items() if not v and self.node(k).op != "input")

    def edges(self) -> list[tuple[str, str]]:
        return [(i, n.name) for n in self.nodes for i in n.inputs]

    @property
    def params(self) -> int:
        return sum(n.params for n in self.nodes)

    @property
    def fwd_flops(self) -> int:
        return sum(n.fwd_flops for n in self.nodes)

    @property
    def bwd_flops(self) -> int:
        return sum(n.bwd_flops for n in self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)
