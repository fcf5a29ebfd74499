"""Training memory per device: parameters, gradients, optimizer state, activations kept for backward
and communication buffers.

Activations: the output of a node is kept when a consumer needs its input for backward (conv, linear,
normalisation, pooling, ...) or when the node needs its own output (ReLU, softmax); views (flatten,
reshape) alias their producer and are counted once; max-pool also keeps its int64 indices. LSTM nodes
also keep their four gates and cell state (approximation: 4x the output). Allocator fragmentation and
framework workspace are not modelled by `training_memory` (the placer's whole-graph count).

`predict_rank_memory` is what one rank of hybridpar's runtime holds at its peak of a training step,
the figure `hybridpar plan` states per device and `hybridpar train` compares its measurement with
(the planner sums the same per-layer terms: `weight_layer_memory`, `join_memory`, `step_memory`):

- weights of the local shard (conv/linear weights and their batch norms: 1/(channel x filter));
- their gradients (same size; `zero_grad(set_to_none=True)` frees them between steps, but they are
  all alive at the end of backward, with the weights);
- optimizer state per optimizer (`optimizer_state_copies`): plain SGD (train's default, momentum 0)
  none, SGD/LARS with momentum one buffer, AdamW two moments;
- activations autograd keeps, at their local shapes: every node's output in a layer (the runtime's
  DTensor pieces, batch / sample x channels / (channel x filter)) and, under stationary-y/-w, the
  input gathered over the filter group, which DistConvFunction saves for the weight gradient;
- communication buckets (hybridpar.runtime.grad_buckets): under sample > 1 every synchronised
  gradient is copied into a flat bucket that stays alive until backward ends (in flight), so the
  buckets together are one more copy of the synchronised gradients;
- the largest transient (one at a time): a distributed conv's forward partial outputs for all its
  filters before the reduce-scatter (stationary-x/-w), its backward gathered output gradient plus the
  input gradient before the reduce-scatter (all algorithms), a redistribution's all-to-all send and
  receive buffers, or the optimizer step's temporary (AdamW's foreach sqrt of the second moment, SGD's
  gradient + weight decay: one copy of the local weights);
- the global input batch (every rank receives it whole) and the model output gathered whole;
- the framework itself: the resident set of an initialised gloo rank less its model's bytes
  (interpreter, torch and the kernels a training step pages in, process groups, the runtime),
  measured by `hybridpar profile` (`Calibration.framework_bytes`) on CPU devices; 0 on GPUs (outside
  torch.cuda.max_memory_allocated).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from math import ceil, prod
from typing import Literal

from hybridpar.cost.compute import local_shapes
from hybridpar.graph.types import DTYPE_BYTES, Graph, Node
from hybridpar.layout import LayerLayout

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


# -- one rank of hybridpar's runtime -----------------------------------------------------------------

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "lars")
DEFAULT_OPTIMIZER = "sgd"  # `hybridpar train`'s default (--optimizer sgd --momentum 0)
# Resident set of an initialised gloo rank less its model's bytes, after two training steps of a tiny
# model through the runtime (hybridpar.profile.framework_memory; torch 2.13, this 2-core machine, 1, 2
# and 4 ranks: 417-426 MiB; 300 MiB before any training step): used on CPU devices when the calibration
# file has no measurement of its own.
LOCALHOST_FRAMEWORK_BYTES = 420 * 2**20
WEIGHT_OPS = ("conv2d", "linear")
JOIN_OPS = ("add", "mul", "concat")


def optimizer_state_copies(optimizer: str = DEFAULT_OPTIMIZER, momentum: float = 0.0) -> int:
    """Buffers of the weights' size the optimizer keeps between steps: torch SGD and LARS keep a
    momentum buffer only when momentum != 0 ("momentum" names SGD with momentum); Adam/AdamW two moments."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {optimizer!r}")
    if optimizer in ("adam", "adamw"):
        return 2
    if optimizer == "momentum":
        return 1
    return 1 if momentum else 0


def optimizer_step_copies(optimizer: str = DEFAULT_OPTIMIZER, weight_decay: float = 0.0) -> int:
    """Temporaries of the weights' size during torch's foreach optimizer step: AdamW's sqrt of the
    second moments; SGD's gradient + weight decay (a new list); none for plain SGD and LARS (per tensor)."""
    if optimizer in ("adam", "adamw"):
        return 1
    if optimizer in ("sgd", "momentum") and weight_decay:
        return 1
    return 0


def framework_bytes_for(device=None, calibration=None) -> float:
    """The per-rank constant of the framework itself: on a CPU device the calibration file's
    measurement (`hybridpar profile`), else LOCALHOST_FRAMEWORK_BYTES; 0 on GPUs."""
    if device is not None and getattr(device, "kind", "cpu") != "cpu":
        return 0.0
    from hybridpar.cluster.calibration import Calibration, load_calibration

    cal = calibration if isinstance(calibration, Calibration) else None
    if cal is None:
        try:
            cal = load_calibration(calibration)
        except Exception:  # noqa: BLE001 - an unreadable file: the built-in figure
            cal = None
    measured = getattr(cal, "framework_bytes", None)
    return float(measured) if measured else float(LOCALHOST_FRAMEWORK_BYTES)


@dataclass(frozen=True)
class LayerMemory:
    """What one layer (a weight layer or a join, with the nodes that follow it) holds on one rank."""

    weights_bytes: float = 0.0
    grads_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    activations_bytes: float = 0.0
    buckets_bytes: float = 0.0
    transient_bytes: float = 0.0  # alive only while this layer runs (not summed over layers)

    @property
    def persistent_bytes(self) -> float:
        return (self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.buckets_bytes)


@dataclass(frozen=True)
class RankMemory:
    """Peak memory of one rank during a training step (bytes), by what holds it."""

    framework_bytes: float
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    buckets_bytes: float
    transient_bytes: float
    io_bytes: float

    @property
    def total_bytes(self) -> float:
        return (self.framework_bytes + self.weights_bytes + self.grads_bytes + self.optimizer_bytes
                + self.activations_bytes + self.buckets_bytes + self.transient_bytes + self.io_bytes)

    def breakdown(self) -> dict[str, float]:
        return {**asdict(self), "total_bytes": self.total_bytes}


def boundary_numel(shape: Sequence[int], batch: int, sample: int, pieces: int) -> int:
    """Elements of an activation on the rank with the largest piece: batch / sample samples, channels
    in `pieces` pieces (the runtime's DTensor shards)."""
    if len(shape) < 2:
        return batch // sample
    spatial = prod(shape[2:]) if len(shape) > 2 else 1
    return batch // sample * ceil(shape[1] / pieces) * spatial


def _kept(nodes: Sequence[Node], batch: int, sample: int, pieces: int, elem: int,
          kept: Collection[str] | None = None) -> float:
    """Bytes of the outputs autograd keeps for backward among `nodes` (`kept`: kept_activations of the
    graph; None counts every output). A batch norm's or an add's output that only feeds a ReLU is freed
    once the ReLU has run: counting every output priced ResNet-50 at 9.2 GiB of activations where an H200
    measured 5.5 GiB for the whole step (2026-11-30, docs/planner.md)."""
    return float(sum(boundary_numel(n.out_shape, batch, sample, pieces) * elem for n in nodes
                     if n.out_shape and (kept is None or n.name in kept)))


def conv_transient_bytes(node: Node, layout: LayerLayout, batch: int, elem: int, *, input_grad: bool = True) -> float:
    """The largest transient buffer of a distributed conv/linear (runtime.layers.conv.DistConvFunction):
    forward, the partial outputs for all this rank's filters before the reduce-scatter in the channel
    group (stationary-x/-w); backward, the output gradient gathered over the channel group plus the
    input gradient for the gathered channels before its reduce-scatter in the filter group."""
    s, c, f = layout.sample, layout.channel, layout.filter
    b = batch // s
    x, y = node.in_shapes[0], node.out_shape
    x_sp = prod(x[2:]) if len(x) > 2 else 1
    y_sp = prod(y[2:]) if len(y) > 2 else 1
    cin = int(x[1]) if len(x) > 1 else 1
    cout = int(y[1]) if len(y) > 1 else 1
    partial = b * ceil(cout / f) * y_sp if c > 1 else 0
    dx = b * ceil(cin / c) * x_sp if input_grad else 0
    return float(max(partial, partial + dx) * elem)


def weight_layer_memory(node: Node, followers: Sequence[Node], layout: LayerLayout, *, batch: int, elem: int,
                        optimizer: str = DEFAULT_OPTIMIZER, momentum: float = 0.0,
                        input_grad: bool = True, kept: Collection[str] | None = None) -> LayerMemory:
    """A conv/linear layer and its followers (batch norm, ReLU, pooling...) under `layout` on one rank;
    `kept`: the graph's kept_activations (the outputs held for backward)."""
    s, g = layout.sample, layout.channel * layout.filter
    weights = (node.params + sum(n.params for n in followers)) / g * elem
    kept_b = _kept([node, *followers], batch, s, g, elem, kept)
    if layout.filter > 1:  # stationary-y/-w keep the input gathered over the filter group for dw
        kept_b += boundary_numel(node.in_shapes[0], batch, s, g) * layout.filter * elem
    return LayerMemory(weights_bytes=weights, grads_bytes=weights,
                       optimizer_bytes=weights * optimizer_state_copies(optimizer, momentum),
                       activations_bytes=kept_b, buckets_bytes=weights if s > 1 else 0.0,
                       transient_bytes=conv_transient_bytes(node, layout, batch, elem, input_grad=input_grad))


def join_memory(nodes: Sequence[Node], *, batch: int, sample: int, pieces: int, elem: int,
                kept: Collection[str] | None = None) -> LayerMemory:
    """A join (add, concat) and its followers on the distribution (sample, pieces)."""
    return LayerMemory(activations_bytes=_kept(nodes, batch, sample, pieces, elem, kept))


def redistribution_transient_bytes(tensor_numel: int, ranks: int, elem: int) -> float:
    """Send and receive buffers of the all-to-all that moves a boundary tensor between distributions."""
    return 2.0 * (tensor_numel // ranks) * elem


def step_memory(layers: Sequence[LayerMemory], *, framework_bytes: float = 0.0, io_bytes: float = 0.0,
                optimizer: str = DEFAULT_OPTIMIZER, weight_decay: float = 0.0,
                extra_transient_bytes: float = 0.0) -> RankMemory:
    """Peak of one rank: every layer's persistent bytes, the largest transient (a layer's, the
    optimizer step's, or `extra_transient_bytes`, e.g. a redistribution), the input/output and the
    framework."""
    weights = sum(m.weights_bytes for m in layers)
    step_tmp = weights * optimizer_step_copies(optimizer, weight_decay)
    transient = max([step_tmp, float(extra_transient_bytes), *(m.transient_bytes for m in layers)])
    return RankMemory(framework_bytes=float(framework_bytes), weights_bytes=weights,
                      grads_bytes=sum(m.grads_bytes for m in layers),
                      optimizer_bytes=sum(m.optimizer_bytes for m in layers),
                      activations_bytes=sum(m.activations_bytes for m in layers),
                      buckets_bytes=sum(m.buckets_bytes for m in layers), transient_bytes=transient,
                      io_bytes=float(io_bytes))


def io_bytes(graph: Graph, batch: int, elem: int) -> float:
    """The global input batch every rank receives and the model output gathered whole on every rank."""
    def whole(n: Node) -> float:
        return float(boundary_numel(n.out_shape, batch, 1, 1) * elem) if n.out_shape else 0.0

    inputs = [n for n in graph.nodes if n.op == "input"]
    return sum(whole(n) for n in inputs) + (whole(graph.nodes[-1]) if graph.nodes else 0.0)


def _layers(graph: Graph) -> list[tuple[Node, list[Node], bool]]:
    """(head, followers, input_grad) per layer, grouped as hybridpar.search.layers.build_layer_graph
    does: a weight layer or join heads a layer; the nodes after it until the next head follow it;
    what runs on the graph input before the first layer belongs to none."""
    owner: dict[str, int | None] = {}
    out: list[tuple[Node, list[Node], bool]] = []
    for node in graph.nodes:
        owners = [owner.get(i) for i in node.inputs]
        distinct = sorted({o for o in owners if o is not None})
        if node.op in WEIGHT_OPS or node.op in JOIN_OPS or len(distinct) > 1:
            owner[node.name] = len(out)
            out.append((node, [], bool(distinct)))
        elif distinct:
            owner[node.name] = distinct[0]
            out[distinct[0]][1].append(node)
        else:
            owner[node.name] = None
    return out


def _as_layout(spec: LayerLayout | str) -> LayerLayout:
    if isinstance(spec, LayerLayout):
        return spec
    degrees = {}
    for part in str(spec).split(","):
        key, _, value = part.partition("=")
        if key.strip() not in ("sample", "channel", "filter") or not value.strip().isdigit():
            raise ValueError(f"layout must be like 'sample=2,channel=2', got {spec!r}")
        degrees[key.strip()] = int(value)
    return LayerLayout(**degrees)


def predict_rank_memory(graph: Graph, layout: LayerLayout | str, *, layers: Mapping[str, LayerLayout] | None = None,
                        batch: int | None = None, optimizer: str = DEFAULT_OPTIMIZER, momentum: float = 0.0,
                        weight_decay: float = 0.0, dtype: str = "fp32",
                        framework_bytes: float | None = None) -> RankMemory:
    """Peak memory of one rank of hybridpar's runtime training `graph` at global batch `batch`
    (default graph.batch) under `layout` (a LayerLayout or a strategy string such as "channel=2"),
    with per-module layouts `layers` overriding it (a Plan's `layers` and `default_layout`).

    The same sum as the planner's per-device memory (hybridpar.search.layers), so `hybridpar plan
    --strategy S` states this figure. framework_bytes: None = this machine's (`framework_bytes_for()`);
    pass 0 for CUDA, where the measured peak is torch.cuda.max_memory_allocated."""
    optimizer_state_copies(optimizer, momentum)  # validates the name
    default = _as_layout(layout)
    layers = layers or {}
    batch = int(batch if batch is not None else graph.batch)
    elem = DTYPE_BYTES[dtype]
    per_layer: list[LayerMemory] = []
    dist: dict[str, tuple[int, int]] = {}
    kept = frozenset(kept_activations(graph))
    for head, followers, input_grad in _layers(graph):
        if head.op in WEIGHT_OPS:
            lay = layers.get(head.module or "", default) if head.module else default
            per_layer.append(weight_layer_memory(head, followers, lay, batch=batch, elem=elem, optimizer=optimizer,
                                                 momentum=momentum, input_grad=input_grad, kept=kept))
            d = (lay.sample, lay.channel * lay.filter)
        else:
            d = next((dist[i] for i in head.inputs if i in dist), (default.sample, default.channel * default.filter))
            per_layer.append(join_memory([head, *followers], batch=batch, sample=d[0], pieces=d[1], elem=elem,
                                         kept=kept))
        for n in (head, *followers):
            dist[n.name] = d
    fw = framework_bytes_for() if framework_bytes is None else float(framework_bytes)
    return step_memory(per_layer, framework_bytes=fw, io_bytes=io_bytes(graph, batch, elem), optimizer=optimizer,
                       weight_decay=weight_decay)


MEMORY_TOLERANCE = 0.20  # `hybridpar train` warns when a rank's measured peak exceeds the plan's by more


def memory_report(measured_by_rank: Sequence[int | float | None], predicted: RankMemory | float,
                  tolerance: float = MEMORY_TOLERANCE) -> dict:
    """Each rank's measured peak beside the prediction, as `hybridpar train --json` reports it:
    {"predicted_bytes", "predicted_breakdown", "ranks": [{"rank", "peak_bytes", "ratio"}], "worst_ratio",
    "warning"}; `warning` is a sentence when some rank's peak exceeds the prediction by more than
    `tolerance` (else None). Ranks that measured nothing (None) are listed without a ratio."""
    total = predicted.total_bytes if isinstance(predicted, RankMemory) else float(predicted)
    ranks = []
    for r, peak in enumerate(measured_by_rank):
        ratio = float(peak) / total if peak is not None and total > 0 else None
        ranks.append({"rank": r, "peak_bytes": None if peak is None else int(peak), "ratio": ratio})
    ratios = [x["ratio"] for x in ranks if x["ratio"] is not None]
    worst = max(ratios, default=None)
    warning = None
    if worst is not None and worst > 1 + tolerance:
        over = [x["rank"] for x in ranks if x["ratio"] is not None and x["ratio"] > 1 + tolerance]
        peak = max(x["peak_bytes"] for x in ranks if x["rank"] in over)
        warning = (f"rank{'s' if len(over) > 1 else ''} {', '.join(map(str, over))} peaked at "
                   f"{peak / 2**30:.2f} GiB, {worst - 1:.0%} over the plan's {total / 2**30:.2f} GiB per rank "
                   f"(tolerance {tolerance:.0%})")
    return {"predicted_bytes": int(total),
            "predicted_breakdown": predicted.breakdown() if isinstance(predicted, RankMemory) else None,
            "ranks": ranks, "worst_ratio": worst, "warning": warning}
