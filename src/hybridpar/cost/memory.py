"""Training memory per device: parameters, gradients, optimizer state, activations kept for backward
and communication buffers.

Activations: the output of a node is kept when a consumer needs its input for backward (conv, linear,
normalisation, pooling, ...) or when the node needs its own output (ReLU, softmax); views (flatten,
reshape) alias their producer and are counted once; max-pool also keeps its int64 indices. LSTM nodes
also keep their four gates and cell state (approximation: 4x the output). Allocator fragmentation and
framework workspace are not modelled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Literal

from hybridpar.cost.compute import local_shapes
from hybridpar.graph.types import DTYPE_BYTES, Graph, Node

Optimizer = Literal["sgd", "momentum", "adam"]
# fp32 state bytes per parameter: momentum buffer; Adam's two moments.
OPTIMIZER_STATE_BYTES = {"sgd": 0, "momentum": 4, "adam": 8}
DDP_BUCKET_BYTES = 25 * 2**20  # torch DistributedDataParallel's default bucket_cap_mb

_NEEDS_INPUT = {"conv2d", "linear", "batchnorm", "layernorm", "maxpool", "avgpool", "adaptive_avgpool",
                "lstm", "attention", "mul", "pointwise", "loss", "embedding"}
_NEEDS_OUTPUT = {"relu", "softmax"}
_VIEWS = {"flatten", "reshape", "dropout"}  # dropout keeps a mask, counted as a view of its input here
_LSTM_STATE_FACTOR = 4
_INDEX_BYTES = 8  # max-pool keeps int64 argmax indices, one per output element


@dataclass(frozen=True)
class MemoryEstimate:
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    comm_buffers_bytes: float

    @property
    def total_bytes(self) -> float:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.comm_buffers_bytes)

    def breakdown(self) -> dict[str, float]:
        return {**asdict(self), "total_bytes": self.total_bytes}


Fractions = tuple[float, float, float]  # (sample_frac, channel_frac, filter_frac)


def _fractions(node: Node, layouts: Mapping[str, Fractions] | None, default: Fractions) -> Fractions:
    if layouts:
        for key in (node.name, node.module):
            if key is not None and key in layouts:
                return layouts[key]
    return default


def kept_activations(graph: Graph) -> list[str]:
    """Names of the nodes whose outputs autograd keeps for backward (views resolved to producers)."""
    def root(name: str) -> str:
        while graph.node(name).op in _VIEWS and graph.node(name).inputs:
            name = graph.node(name).inputs[0]
        return name

    kept: dict[str, None] = {}
    for n in graph.nodes:
        if n.op in _NEEDS_OUTPUT or n.op == "lstm":
            kept[root(n.name)] = None
        if n.op in _NEEDS_INPUT:
            for i in n.inputs:
                kept[root(i)] = None
    return list(kept)


def training_memory(graph: Graph, *, dtype: str = "fp32", optimizer: Optimizer = "momentum",
                    sample_frac: float = 1.0, layouts: Mapping[str, Fractions] | None = None,
                    dp_ranks: int = 1, comm_buffer_bytes: float | None = None,
                    bucket_bytes: int = DDP_BUCKET_BYTES) -> MemoryEstimate:
    """Memory of one device training `graph` (its batch) with each node at its local shape.

    layouts: node or module name -> (sample_frac, channel_frac, filter_frac); others use
    (sample_frac, 1, 1). Parameters shrink with the weight shard (channel x filter fraction).
    Mixed precision (fp16/bf16) adds fp32 master weights. Communication buffers: `comm_buffer_bytes`
    when given, else DDP-style gradient buckets (two of `bucket_bytes`, at most the gradients) when
    dp_ranks > 1."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATE_BYTES)}, got {optimizer!r}")
    b = DTYPE_BYTES[dtype]
    default = (sample_frac, 1.0, 1.0)
    params = 0.0
    for n in graph.nodes:
        if n.params:
            params += n.params * local_shapes(n, *_fractions(n, layouts, default)).w_frac
    kept = set(kept_activations(graph))
    acts = 0.0
    for n in graph.nodes:
        if n.name in kept and n.out_shape:
            loc = local_shapes(n, *_fractions(n, layouts, default))
            factor = 1 + (_LSTM_STATE_FACTOR if n.op == "lstm" else 0)
            acts += n.out_numel * b * loc.y_frac * factor
        if n.op == "maxpool" and n.out_shape:
            acts += n.out_numel * _INDEX_BYTES * local_shapes(n, *_fractions(n, layouts, default)).y_frac
    master = 4 if b < 4 else 0
    grads = params * b
    if comm_buffer_bytes is None:
        comm_buffer_bytes = min(2.0 * bucket_bytes, grads) if dp_ranks > 1 else 0.0
    return MemoryEstimate(params_bytes=params * (b + master), grads_bytes=grads,
                          optimizer_bytes=params * OPTIMIZER_STATE_BYTES[optimizer],
                          activations_bytes=acts, comm_buffers_bytes=float(comm_buffer_bytes))
