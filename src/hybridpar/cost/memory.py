"""Training memory per device: parameters, gradients, optimizer state, activations kept for backward
and communication buffers.

Activations (`node_kept_bytes`, one rule for `training_memory`, the placer's whole-graph count, and
`predict_rank_memory`, the per-layer planner's): the output of a node is kept when a consumer needs its
input for backward (conv, linear, normalisation, pooling, ...) or when the node needs its own output
(ReLU, softmax, sigmoid, tanh); views (flatten, reshape) alias their producer and are counted once; a
global average pool, an upsample and a product with a number keep nothing; max-pools (adaptive ones too)
also keep their int64 indices; layer/group/RMS norms their per-row statistics; recurrent layers and
attention keep state inside them (`internal_numel`). Checked per layer kind against the storages
autograd saves (torch 2.13 CPU, tests/cost/test_memory_pool.py).
Allocator fragmentation and framework workspace are not modelled by `training_memory`.

Spatial layouts (depth/height/width, uniform over the model): the same sum over one rank's view of
the graph (hybridpar.cost.spatial.local_graph): activations cut to the rank's spatial piece (about
1/(depth x height x width) of a sample's), plus the halo rows each convolution and pooling received
(kept for backward, where the input window is re-assembled: a transient of the conv's backward; max
pools recompute their indices there); weights whole.

`predict_rank_memory` is what one rank of hybridpar's runtime holds at its peak of a training step,
the figure `hybridpar plan` states per device and `hybridpar train` compares its measurement with
(the planner sums the same per-layer terms: `weight_layer_memory`, `nodes_memory`, `step_memory`):

- weights of the local shard (conv/linear weights and their batch norms: 1/(channel x filter)), every
  other parameter whole (embeddings, recurrent and attention layers, layer/group norms); the nodes
  before the first conv/linear/join (an embedding, recurrent layers over it) on the first layer's
  distribution, as the planner prices their time;
- their gradients (same size; `zero_grad(set_to_none=True)` frees them between steps, but they are
  all alive at the end of backward, with the weights);
- optimizer state per optimizer (`optimizer_state_copies`): plain SGD (train's default, momentum 0)
  none, SGD/LARS with momentum one buffer, AdamW two moments;
- activations autograd keeps, at their local shapes (`node_kept_bytes`): every kept node's output in
  a layer (the runtime's DTensor pieces, batch / sample x channels / (channel x filter); a recurrent
  layer whole for the rank's samples) with the state recurrent and attention nodes keep inside and
  max-pools' int64 indices, and,
  under stationary-y/-w, the input gathered over the filter group, which DistConvFunction saves for
  the weight gradient;
- communication buckets (hybridpar.parallel.comm.grad_sync): under sample > 1 every synchronised
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

import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from math import ceil, prod
from typing import TYPE_CHECKING, Literal

from hybridpar.cost.compute import local_shapes
from hybridpar.cost.scaling import graph_at_batch, shape_at_batch
from hybridpar.graph.types import DTYPE_BYTES, Graph, Node
from hybridpar.layout import LayerLayout
from hybridpar.layout.blocks import block_of, block_zeros  # one rule with the runtime (block_of re-exported)

if TYPE_CHECKING:
    from hybridpar.cluster.calibration import Calibration
    from hybridpar.cluster.model import DeviceSpec

Optimizer = Literal["sgd", "momentum", "adam"]
# fp32 state bytes per parameter: momentum buffer; Adam's two moments.
OPTIMIZER_STATE_BYTES = {"sgd": 0, "momentum": 4, "adam": 8}
DDP_BUCKET_BYTES = 25 * 2**20  # torch DistributedDataParallel's default bucket_cap_mb

_NEEDS_INPUT = {"conv2d", "conv", "linear", "batchnorm", "layernorm", "maxpool", "avgpool", "adaptive_avgpool",
                "lstm", "attention", "mul", "pointwise", "loss", "embedding"}
_NEEDS_OUTPUT = {"relu", "softmax"}
_VIEWS = {"flatten", "reshape", "dropout"}  # dropout: when it drops nothing (eval, p = 0; else `_is_view`)
_INDEX_BYTES = 8  # max-pools keep int64 argmax indices, one per output element
# Layouts shard the parameters of these ops (hybridpar.cost.layout_comm); every other parameter
# (embedding, recurrent, attention, layer/group norm, free parameters) is whole on every rank.
SHARDED_OPS = ("conv2d", "linear", "batchnorm")
# Recurrent layers: no layout splits them; every rank of a sample group runs the whole layer on its samples.
WHOLE_OPS = ("lstm",)


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


def _is_view(node: Node) -> bool:
    """A node whose output aliases its input: flatten/reshape, and dropout that drops nothing (a dropout
    in training with p > 0 writes a new tensor and keeps its noise: `internal_numel`)."""
    if node.attr("window_freed") is True:  # a spatial window (cost.spatial.local_graph): its op keeps the piece
        return True
    return node.op in _VIEWS and not (node.op == "dropout" and node.attr("p"))


def kept_activations(graph: Graph) -> list[str]:
    """Names of the nodes whose outputs autograd keeps for backward (views resolved to producers)."""
    def root(name: str) -> str:
        while _is_view(graph.node(name)) and graph.node(name).inputs:
            name = graph.node(name).inputs[0]
        return name

    kept: dict[str, None] = {}
    for n in graph.nodes:
        needs_input, needs_output = _keeps(n)
        if needs_output:
            kept[root(n.name)] = None
        if needs_input:
            for i in n.inputs:
                kept[root(i)] = None
    return list(kept)


def _keeps(node: Node) -> tuple[bool, bool]:
    """(whether autograd keeps `node`'s inputs, its output) for its backward (torch 2.13, measured with
    saved_tensors_hooks: tests/cost/test_memory_pool.py)."""
    saves = node.attr("saves")  # graph.ops: sigmoid/tanh/exp keep their output, upsampling nothing
    if saves in ("output", "nothing"):
        return False, saves == "output"
    if node.attr("scalar"):  # x * 0.5, x / 3: the number is all backward needs
        return False, False
    if node.op == "adaptive_avgpool" and not node.attr("max") and len(node.out_shape) >= 3 \
            and all(d == 1 for d in node.out_shape[2:]):
        return False, False  # a global average pool runs as a mean: backward needs only the input's shape
    # recurrent layers and scaled_dot_product_attention keep their own outputs too
    needs_output = node.op in _NEEDS_OUTPUT or node.op == "lstm" or (node.op == "attention" and bool(node.attr("sdpa")))
    return node.op in _NEEDS_INPUT, needs_output


def _recurrent_numel(node: Node) -> float:
    """What torch's CPU kernels keep inside nn.LSTM/GRU/RNN (torch 2.13, fp32; measured with
    saved_tensors_hooks over hidden 16-256, input 16-256, 1-3 layers, one and two directions, with and
    without projections, docs/planner.md). Per layer and direction: an LSTM (oneDNN) a workspace of
    about 9.5 H + 6 max(I, H) values per sample and step (gates, h and c states) and 10 H + 7.5 max(I, H)
    per sample (a least-squares fit over 108 shapes, B 4-8, T 4-32, H 16-128, I 16-128: median 3.5%,
    within 16% where B x T >= 96; 32% for the smallest; in proportion to the batch, so that a graph
    traced at one batch sizes another), plus h0, c0, hy, cy; an LSTM with projections (torch's own
    cells: oneDNN has none) 7 H + P
    per step, a GRU 7 H (gates and h), an RNN H per step and h0. Every layer's output but the last
    (the next layer's input); with two directions, an oneDNN LSTM each direction's output of the last
    layer, torch's cells a reversed copy of the input. On GPUs cuDNN's reserve space differs
    (approximation)."""
    a = dict(node.attrs)
    shape = node.out_shape
    if len(shape) == 3:
        b, t = (shape[0], shape[1]) if a.get("batch_first") else (shape[1], shape[0])
    else:  # unbatched (steps, features)
        b, t = 1, shape[0]
    h, layers = int(a.get("hidden") or shape[-1]), int(a.get("layers") or 1)
    proj = int(a.get("proj") or 0)
    d = 2 if a.get("bidirectional") else 1
    cell = a.get("cell", "lstm")
    onednn = cell == "lstm" and not proj
    n: float = (layers - 1) * b * t * d * (proj or h)
    for layer in range(layers):
        width = int(a.get("input_size") or h) if layer == 0 else d * (proj or h)
        if onednn:
            w = max(width, h)
            n += d * (b * t * (9.5 * h + 6 * w) + b * (10 * h + 7.5 * w) + 4 * b * h)
        elif cell == "lstm":
            n += d * b * t * (7 * h + proj)
        else:
            n += d * (7 * b * t * h if cell == "gru" else (t + 1) * b * h)
    if d > 1:
        n += d * b * t * h if onednn else b * t * int(a.get("input_size") or h)
    return n


def internal_numel(node: Node) -> float:
    """Elements (at the node's whole batch) autograd keeps inside `node` besides its inputs and its
    output: a recurrent layer's state (`_recurrent_numel`); a dropout's noise (training, p > 0);
    scaled_dot_product_attention's log-sum-exp
    per query row (the flash kernels, CPU and GPU) or, with attention dropout, what torch's math path
    keeps (the CPU's choice then; GPU kernels keep the flash figure, so an over-estimate there): the
    scaled q and k, the scores' softmax, the dropout noise and the dropped scores; a whole
    nn.MultiheadAttention (a torch.fx leaf) its q, k, v projections and attention output, 4x its output.
    Measured with saved_tensors_hooks on nn.TransformerEncoderLayer (docs/planner.md)."""
    if not node.out_numel:
        return 0
    if node.attr("window_freed") is True:  # the halo rows a spatially split op keeps (cost.spatial.local_graph)
        return float(node.attr("kept_numel") or 0)
    if node.op == "lstm":
        return _recurrent_numel(node)
    if node.op == "dropout" and node.attr("p"):  # its noise (CPU: the activation's dtype; GPUs a bool mask)
        return node.out_numel
    if node.op == "layernorm" and node.attr("stat_numel"):
        rows = node.out_numel / node.attr("stat_numel")  # a mean and 1/std per group (RMS: 1/rms)
        if node.attr("rms"):
            return rows + (node.out_numel if node.attr("rms_weight") else 0)  # and x / rms for the weight
        return 2 * rows
    if node.op == "attention":
        rows = node.out_numel // max(node.out_shape[-1], 1)  # batch x heads x queries
        if node.attr("sdpa") and node.attr("dropout") and len(node.in_shapes) >= 2:
            q, k = node.in_shapes[0], node.in_shapes[1]
            return prod(q) + prod(k) + 3 * rows * (k[-2] if len(k) >= 2 else 1)
        if node.attr("sdpa"):
            return rows
        if node.params:
            return 4 * node.out_numel
    return 0


def node_kept_bytes(node: Node, kept: bool, elem: int, out_numel: float | None = None) -> float:
    """Bytes autograd keeps for backward on behalf of `node` when `out_numel` elements of its output are
    on this rank (default: all): the output when `kept` (kept_activations), the state it keeps inside
    (`internal_numel`, in proportion to its output) and a max-pool's int64 indices (adaptive ones too)."""
    if not node.out_numel:
        return 0.0
    local = float(node.out_numel if out_numel is None else out_numel)
    acts = local * elem if kept else 0.0
    inner = internal_numel(node)
    if inner:
        acts += inner * local / node.out_numel * elem
    if (node.op == "maxpool" or (node.op == "adaptive_avgpool" and node.attr("max"))) \
            and node.attr("indices") is not False:  # a spatially split max pool recomputes them instead
        acts += local * _INDEX_BYTES
    return acts


def held_params(nodes: Sequence[Node], pieces: int = 1) -> float:
    """Parameters of `nodes` one rank holds when their layer's weights are cut in `pieces` shards: a
    conv/linear/batch norm's shard (SHARDED_OPS), any other node's whole."""
    sharded = sum(n.params for n in nodes if n.op in SHARDED_OPS)
    return sharded / pieces + sum(n.params for n in nodes if n.op not in SHARDED_OPS)


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
        if n.out_numel:
            y_frac = local_shapes(n, *_fractions(n, layouts, default)).y_frac
            acts += node_kept_bytes(n, n.name in kept, b, n.out_numel * y_frac)
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


def framework_bytes_for(device: DeviceSpec | None = None,
                        calibration: Calibration | str | os.PathLike | None = None) -> float:
    """The per-rank constant of the framework itself: on a CPU device the calibration file's
    measurement (`hybridpar profile`), else LOCALHOST_FRAMEWORK_BYTES; 0 on GPUs."""
    if device is not None and getattr(device, "kind", "cpu") != "cpu":
        return 0.0
    from hybridpar.cluster.calibration import resolve_calibration

    try:
        cal = resolve_calibration(calibration, default=True)
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


def local_numel(shape: Sequence[int], batch: int, sample: int, pieces: int, graph_batch: int | None = None) -> int:
    """`boundary_numel` of an activation whose shape was traced at `graph_batch` samples (default:
    `batch`), when its first dimension is the batch (at `batch` or `graph_batch`). A tensor whose first
    dimension is not (time-major: a recurrent layer's (steps, batch, features), the projections inside
    nn.MultiheadAttention, (steps x batch, features)) at `batch` (hybridpar.cost.scaling.shape_at_batch,
    the planner's rule for its time) splits over the sample groups, its channels whole (approximation)."""
    gb = graph_batch or batch
    if len(shape) >= 2 and shape[0] not in (batch, gb):
        return prod(shape_at_batch(shape, batch, gb)) // sample
    return boundary_numel(shape, batch, sample, pieces)


def _kept(nodes: Sequence[Node], batch: int, sample: int, pieces: int, elem: int,
          kept: Collection[str] | None = None, graph_batch: int | None = None) -> float:
    """Bytes autograd keeps for backward among `nodes` at their local shapes (`node_kept_bytes`,
    `local_numel`; `kept`: kept_activations of the graph, None counts every output): a recurrent layer
    whole for the rank's samples, any other node's output in `pieces` channel pieces. A batch norm's or
    an add's output that only feeds a ReLU is freed once the ReLU has run: counting every output priced
    ResNet-50 at 9.2 GiB of activations where an H200 measured 5.5 GiB for the whole step (2026-11-30,
    docs/planner.md). Max-pools' int64 indices are counted (autograd keeps them, on GPUs too: 1.9% of
    ResNet-50's activations; left out before, small_cnn was 9% and inception_mini 27% under the storages
    autograd saves)."""
    return float(sum(node_kept_bytes(n, kept is None or n.name in kept, elem,
                                     local_numel(n.out_shape, batch, sample, 1 if n.op in WHOLE_OPS else pieces,
                                                 graph_batch))
                     for n in nodes if n.out_shape))


def _rows_channels(shape: Sequence[int], op: str, batch: int, sample: int) -> tuple[int, int]:
    """(rows on a rank, channels) of a conv/linear activation at `batch`, as hybridpar.cost.layout_comm
    splits it: a conv's samples x pixels and its channels (dim 1); a linear's every dimension but the
    last (samples, and steps: time-major shapes too) and its features (the last)."""
    if op == "linear" and len(shape) > 1:
        return prod(shape[:-1]) // sample, int(shape[-1])
    return batch // sample * (prod(shape[2:]) if len(shape) > 2 else 1), (int(shape[1]) if len(shape) > 1 else 1)


def conv_transient_bytes(node: Node, layout: LayerLayout, batch: int, elem: int, *, input_grad: bool = True) -> float:
    """The largest transient buffer of a distributed conv/linear (runtime.layers.conv.DistConvFunction):
    forward, the partial outputs for all this rank's filters before the reduce-scatter in the channel
    group (stationary-x/-w); backward, the output gradient gathered over the channel group plus the
    input gradient for the gathered channels before its reduce-scatter in the filter group. `node`'s
    shapes at `batch` (hybridpar.cost.scaling.graph_at_batch)."""
    s, c, f = layout.sample, layout.channel, layout.filter
    x_rows, cin = _rows_channels(node.in_shapes[0], node.op, batch, s)
    y_rows, cout = _rows_channels(node.out_shape, node.op, batch, s)
    partial = y_rows * ceil(cout / f) if c > 1 else 0
    dx = x_rows * ceil(cin / c) if input_grad else 0
    if node.attr("rebuilds_window"):  # a spatially split conv re-assembles its input window in backward
        dx += x_rows * ceil(cin / c)
    return float(max(partial, partial + dx) * elem)


# ATen's CPU convolution takes oneDNN unless one sample meets small shapes: ConvUtils' use_mkldnn, fp32,
# as measured here (torch 2.13, profiler allocation events): batch 1, groups 1, a kernel not larger than
# 3 in both of its last two dims and N*C*size(2)*size(3) <= 20480 run the unfold path (slow_conv3d,
# thnn_conv2d); batch >= 2, groups > 1, a 5x5 kernel or a larger input take oneDNN
_ONEDNN_MIN_ELEMENTS = 20480


def cpu_unfold_bytes(node: Node, batch: int, sample: int, elem: int) -> float:
    """The column buffer a CPU convolution allocates when ATen runs it by unfolding its input (im2col):
    C_in x prod(kernel) x the output's pixels of the one sample, once in forward (freed at its end) and
    again in backward beside the input gradient; 0 where oneDNN runs it or nothing needs unfolding (a
    1x1 kernel at stride 1 without padding). CosmoFlow at 4x48^3, batch 1: the step's peak was 1.94x the
    prediction without it (benchmarks/bench_memory.py --spatial)."""
    if node.op not in ("conv2d", "conv") or elem != 4 or node.attr("transposed") or not node.in_shapes:
        return 0.0
    x, y = node.in_shapes[0], node.out_shape
    kernel, stride, padding = node.attr("kernel"), node.attr("stride"), node.attr("padding")
    if kernel is None or y is None or len(x) < 4 or (node.attr("groups") or 1) != 1 or isinstance(padding, str):
        return 0.0
    n = max(1, batch // sample)
    if n > 1 or (kernel[-1] > 3 and kernel[-2] > 3) or n * x[1] * x[2] * x[3] > _ONEDNN_MIN_ELEMENTS:
        return 0.0
    if all(k == 1 for k in kernel) and all(s == 1 for s in stride or ()) and not any(padding or ()):
        return 0.0
    return float(x[1] * prod(kernel) * prod(y[2:]) * elem)


def weight_layer_memory(node: Node, followers: Sequence[Node], layout: LayerLayout, *, batch: int, elem: int,
                        optimizer: str = DEFAULT_OPTIMIZER, momentum: float = 0.0,
                        input_grad: bool = True, kept: Collection[str] | None = None,
                        graph_batch: int | None = None) -> LayerMemory:
    """A conv/linear layer and its followers (batch norm, ReLU, pooling...) under `layout` on one rank;
    `kept`: the graph's kept_activations (the outputs held for backward); the layer's shapes at `batch`
    (`graph_batch`: the batch the followers' shapes were traced at, `local_numel`). On a CPU device
    add `with_cpu_unfold`."""
    s, g = layout.sample, layout.channel * layout.filter
    mem = nodes_memory([node, *followers], batch=batch, sample=s, pieces=g, elem=elem, optimizer=optimizer,
                       momentum=momentum, kept=kept, graph_batch=graph_batch)
    gathered = 0.0
    if layout.filter > 1:  # stationary-y/-w keep the input gathered over the filter group for dw
        rows, cin = _rows_channels(node.in_shapes[0], node.op, batch, s)
        gathered = rows * ceil(cin / g) * layout.filter * elem
    return replace(mem, activations_bytes=mem.activations_bytes + gathered,
                   transient_bytes=conv_transient_bytes(node, layout, batch, elem, input_grad=input_grad))


def with_cpu_unfold(mem: LayerMemory, nodes: Sequence[Node], layout: LayerLayout, batch: int, elem: int,
                    graph_batch: int | None = None) -> LayerMemory:
    """A group's memory (`weight_layer_memory`, `nodes_memory`) on a CPU device: each unsplit
    convolution's column buffer (`cpu_unfold_bytes`) is alive in its backward beside its input gradient
    (a weight conv's input gradient is already its transient; a 1-D/3-D conv, which groups with the
    nodes around it, adds its own). A channel/filter split's pieces run other kernels: not counted."""
    if layout.channel * layout.filter > 1 or not nodes:
        return mem
    s, head = layout.sample, nodes[0]
    own = cpu_unfold_bytes(head, batch, s, elem) if head.op in WEIGHT_OPS else 0.0
    others = [u + local_numel(n.in_shapes[0], batch, s, 1, graph_batch) * elem for n in nodes
              if not (n is head and head.op in WEIGHT_OPS) and (u := cpu_unfold_bytes(n, batch, s, elem)) > 0]
    return replace(mem, transient_bytes=max([mem.transient_bytes + own, *others]))


def nodes_memory(nodes: Sequence[Node], *, batch: int, sample: int, pieces: int, elem: int,
                 optimizer: str = DEFAULT_OPTIMIZER, momentum: float = 0.0,
                 kept: Collection[str] | None = None, graph_batch: int | None = None) -> LayerMemory:
    """`nodes` run on the distribution (sample, pieces): a weight layer and its followers, a join (add,
    concat) and its followers, or the nodes before the first layer (an embedding, recurrent layers over
    it), which run on the first layer's distribution. Parameters per `held_params` with their gradients,
    optimizer state and, under sample > 1, their bucket copies; activations per `_kept`."""
    weights = held_params(nodes, pieces) * elem
    return LayerMemory(weights_bytes=weights, grads_bytes=weights,
                       optimizer_bytes=weights * optimizer_state_copies(optimizer, momentum),
                       activations_bytes=_kept(nodes, batch, sample, pieces, elem, kept, graph_batch),
                       buckets_bytes=weights if sample > 1 else 0.0)


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


def layer_groups(graph: Graph) -> tuple[list[tuple[Node, list[Node], bool]], list[Node]]:
    """(head, followers, input_grad) per layer, and the prefix: how hybridpar.search.layers.build_layer_graph
    and predict_rank_memory see a graph. A weight layer or join heads a layer; the nodes after it until
    the next head follow it. The prefix is what runs on the graph input before the first layer (an
    embedding, recurrent layers). `input_grad`: whether autograd computes the gradient of the head's
    input, i.e. some node upstream has trainable parameters (a prologue's embedding too; the graph
    inputs never need one), as hybridpar.cost.layout_comm.model_collectives decides it."""
    owner: dict[str, int | None] = {}
    grad: dict[str, bool] = {}  # whether a node's output needs a gradient
    out: list[tuple[Node, list[Node], bool]] = []
    prefix: list[Node] = []
    for node in graph.nodes:
        input_grad = any(grad.get(i, False) for i in node.inputs)
        grad[node.name] = node.op != "input" and (bool(node.param_shapes) or input_grad)
        owners = [owner.get(i) for i in node.inputs]
        distinct = sorted({o for o in owners if o is not None})
        if node.op in WEIGHT_OPS or node.op in JOIN_OPS or len(distinct) > 1:
            owner[node.name] = len(out)
            out.append((node, [], input_grad))
        elif distinct:
            owner[node.name] = distinct[0]
            out[distinct[0]][1].append(node)
        else:
            owner[node.name] = None
            if node.op != "input":
                prefix.append(node)
    return out, prefix


def _as_layout(spec: LayerLayout | str) -> LayerLayout:
    if isinstance(spec, LayerLayout):
        return spec
    degrees = {}
    for part in str(spec).split(","):
        key, _, value = part.partition("=")
        if key.strip() not in ("sample", "channel", "filter", "zero", "depth", "height", "width") \
                or not value.strip().isdigit():
            raise ValueError(f"layout must be like 'sample=2,channel=2', 'sample=4,zero=3' or 'height=2', got {spec!r}")
        degrees[key.strip()] = int(value)
    return LayerLayout(**degrees)


def predict_rank_memory(graph: Graph, layout: LayerLayout | str, *, layers: Mapping[str, LayerLayout] | None = None,
                        batch: int | None = None, optimizer: str = DEFAULT_OPTIMIZER, momentum: float = 0.0,
                        weight_decay: float = 0.0, dtype: str = "fp32",
                        framework_bytes: float | None = None,
                        recompute: str | Collection[str] = "none") -> RankMemory:
    """Peak memory of one rank of hybridpar's runtime training `graph` at global batch `batch`
    (default graph.batch) under `layout` (a LayerLayout or a strategy string such as "channel=2"),
    with per-module layouts `layers` overriding it (a Plan's `layers` and `default_layout`).

    The same sum as the planner's per-device memory (hybridpar.search.layers), so `hybridpar plan
    --strategy S` states this figure. framework_bytes: None = this machine's (`framework_bytes_for()`);
    pass 0 for CUDA, where the measured peak is torch.cuda.max_memory_allocated. The same switch
    says whether the ranks compute on CPUs (framework_bytes None or > 0): there ATen's unfolded
    convolutions add their column buffers (`cpu_unfold_bytes`), on GPUs (0) they do not.

    `layout.zero` 2/3 (parameters sharded over the sample ranks, FSDP2) and `recompute="all"` (each
    block's activations recomputed in backward): `sharded_step_memory`'s rule, over the runtime's
    blocks (`block_of`). A mixed per-block plan: `layers` whose zero levels differ by block
    (hybridpar.layout.blocks.block_zeros) and `recompute` the blocks that recompute (a collection of
    names, Plan.recompute_blocks)."""
    optimizer_state_copies(optimizer, momentum)  # validates the name
    if isinstance(recompute, str) and recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {list(RECOMPUTE)}, got {recompute!r}")
    default = _as_layout(layout)
    layers = layers or {}
    batch = int(batch if batch is not None else graph.batch)
    if default.spatial > 1:  # a uniform spatial layout: one rank's pieces and halo windows (cost.spatial)
        from hybridpar.cost.spatial import local_graph, proxy_layout

        if any(lay != default for lay in layers.values()):
            raise ValueError(f"{default.to_strategy()}: spatial layouts run uniformly (no per-layer layouts)")
        pieces = local_graph(graph_at_batch(graph, batch), default)
        return predict_rank_memory(pieces, proxy_layout(default), batch=pieces.batch, optimizer=optimizer,
                                   momentum=momentum, weight_decay=weight_decay, dtype=dtype,
                                   framework_bytes=framework_bytes, recompute=recompute)
    zeros, why = block_zeros(layers, default)
    if why is not None:
        raise ValueError(why)
    parts = block_memory(graph, default, layers=layers, batch=batch, optimizer=optimizer, momentum=momentum,
                         weight_decay=weight_decay, dtype=dtype, framework_bytes=framework_bytes)
    if any(z != default.zero for z in zeros.values()):  # a mixed per-block plan
        return parts.at({b: zeros.get(b, default.zero) for b in dict.fromkeys([*parts.owners, *parts.params])},
                        recompute)
    return parts.at(default.zero, recompute)


@dataclass(frozen=True)
class BlockMemory:
    """One split's per-layer memory terms by runtime block (`block_of`), priced at any per-block choice
    of sharding and recomputation (`at`) without walking the graph again: the planner's per-block
    search (hybridpar.search.layers.fsdp_blocks) and `predict_rank_memory` share it."""

    layers: tuple[LayerMemory, ...]
    owners: tuple[str, ...]  # the block of each entry of `layers` ("" the root's own)
    block_inputs: Mapping[str, float]  # a block's input on this rank: what recomputation keeps of it
    params: Mapping[str, tuple[float, float]]  # fsdp_block_bytes: what FSDP would hold per block, and the rest
    sample: int
    framework_bytes: float
    io_bytes: float
    optimizer: str = DEFAULT_OPTIMIZER
    weight_decay: float = 0.0

    def at(self, zero: int | Mapping[str, int] = 0, recompute: str | Collection[str] = "none") -> RankMemory:
        """The peak with `zero` (a level, or block -> level) and `recompute` ("none", "all" or blocks)."""
        if (zero if isinstance(zero, int) else any(zero.values())) or recompute != "none":
            mem = sharded_step_memory(self.layers, self.owners, self.block_inputs, sample=self.sample, zero=zero,
                                      recompute=recompute, params=self.params, optimizer=self.optimizer,
                                      weight_decay=self.weight_decay)
            return replace(mem, framework_bytes=self.framework_bytes, io_bytes=self.io_bytes)
        return step_memory(self.layers, framework_bytes=self.framework_bytes, io_bytes=self.io_bytes,
                           optimizer=self.optimizer, weight_decay=self.weight_decay)


def block_memory(graph: Graph, default: LayerLayout, *, layers: Mapping[str, LayerLayout] | None = None,
                 batch: int | None = None, optimizer: str = DEFAULT_OPTIMIZER, momentum: float = 0.0,
                 weight_decay: float = 0.0, dtype: str = "fp32", framework_bytes: float | None = None) -> BlockMemory:
    """`predict_rank_memory`'s per-layer terms of a sample x channel/filter split (`default`, per-module
    `layers`; their zero levels are `BlockMemory.at`'s to choose), by block."""
    from hybridpar.cost.layout_comm import splits_by_layout

    layers = layers or {}
    batch = int(batch if batch is not None else graph.batch)
    graph = graph_at_batch(graph, batch)  # its shapes at the batch, as the planner prices them
    elem = DTYPE_BYTES[dtype]
    per_layer: list[LayerMemory] = []
    dist: dict[str, tuple[int, int]] = {}
    kept = frozenset(kept_activations(graph))
    heads, prefix = layer_groups(graph)
    first: tuple[int, int] | None = None
    owners: list[str] = []  # the runtime block of each entry of per_layer
    block_inputs: dict[str, float] = {}  # a block's input on this rank: what recomputation keeps of it
    for head, followers, input_grad in heads:
        owner = block_of(head.module) if head.module else (owners[-1] if owners else "")
        owners.append(owner)
        if owner and owner not in block_inputs and head.in_shapes:
            s_in, g_in = next((dist[i] for i in head.inputs if i in dist),
                              (default.sample, default.channel * default.filter))
            block_inputs[owner] = float(local_numel(head.in_shapes[0], batch, s_in, g_in, graph.batch) * elem)
        if head.op in WEIGHT_OPS:
            lay = layers.get(head.module or "", default) if head.module else default
            # a conv/linear the runtime leaves whole holds whole (the planner's weight_layer_cost too)
            local = lay if splits_by_layout(head) else LayerLayout(sample=lay.sample)
            mem = weight_layer_memory(head, followers, local, batch=batch, elem=elem, optimizer=optimizer,
                                      momentum=momentum, input_grad=input_grad, kept=kept, graph_batch=graph.batch)
            d = (lay.sample, lay.channel * lay.filter)
        else:
            d = next((dist[i] for i in head.inputs if i in dist), (default.sample, default.channel * default.filter))
            local = LayerLayout(sample=d[0], channel=d[1])
            mem = nodes_memory([head, *followers], batch=batch, sample=d[0], pieces=d[1], elem=elem,
                               optimizer=optimizer, momentum=momentum, kept=kept, graph_batch=graph.batch)
        # framework_bytes 0: a GPU (predict_rank_memory); else CPU ranks, with ATen's unfold buffers
        per_layer.append(with_cpu_unfold(mem, [head, *followers], local, batch, elem, graph.batch)
                         if framework_bytes != 0 else mem)
        first = first or d
        for n in (head, *followers):
            dist[n.name] = d
    if prefix:  # on the first layer's distribution, as the planner prices their time
        s0, g0 = first or (default.sample, default.channel * default.filter)
        mem = nodes_memory(prefix, batch=batch, sample=s0, pieces=g0, elem=elem, optimizer=optimizer,
                           momentum=momentum, kept=kept, graph_batch=graph.batch)
        per_layer.append(with_cpu_unfold(mem, prefix, LayerLayout(sample=s0, channel=g0), batch, elem, graph.batch)
                         if framework_bytes != 0 else mem)
        owners.append("")
    fw = framework_bytes_for() if framework_bytes is None else float(framework_bytes)
    held = fsdp_block_bytes(graph, default.model_copy(update={"zero": 3}), elem)  # what FSDP would hold
    return BlockMemory(tuple(per_layer), tuple(owners), block_inputs, held, default.sample, fw,
                       io_bytes(graph, batch, elem), optimizer, weight_decay)




RECOMPUTE = ("none", "all")


def fsdp_block_bytes(graph: Graph, layout: LayerLayout, elem: int) -> dict[str, tuple[float, float]]:
    """Per block ("" the root's own): (bytes of the parameters FSDP2 shards, whole, as held: the local
    pieces under channel/filter; bytes of those that stay replicated with GradSync) on the rank at grid
    position 0, which holds the largest pieces (torch.chunk's convention): one rule with the bytes
    FSDP sends (hybridpar.cost.layout_comm.fsdp_numel / fsdp_replaced)."""
    from hybridpar.cost.layout_comm import fsdp_numel, fsdp_replaced

    out = {b: (float(n * elem), 0.0) for b, n in fsdp_numel(graph, layout, padded=False).items()}
    for node in graph.nodes:
        if node.params and not fsdp_replaced(node, layout):
            b = block_of(node.module or "")
            have = out.get(b, (0.0, 0.0))
            out[b] = (have[0], have[1] + node.params * elem)
    return out


def sharded_step_memory(layers: Sequence[LayerMemory], owners: Sequence[str], block_inputs: Mapping[str, float], *,
                        sample: int, zero: int | Mapping[str, int] = 0, recompute: str | Collection[str] = "none",
                        params: Mapping[str, tuple[float, float]] | None = None,
                        optimizer: str = DEFAULT_OPTIMIZER, weight_decay: float = 0.0) -> RankMemory:
    """Peak of one rank when the sample dimension shards the parameters (`zero`, FSDP2 over `sample`
    ranks) and/or blocks recompute their activations; `owners[i]`: the block of `layers[i]` ("": the
    root's own, never recomputed); `block_inputs`: a block's input bytes on this rank. `zero` and
    `recompute` per block (a mixed plan): a mapping block -> level (blocks it does not name: 0) and
    the collection of blocks that recompute.

    zero=3: parameters, gradients and optimizer state / S, plus one block's parameters gathered whole
    (in flight: the largest block's) and the root's own (FSDP2 keeps the root gathered); zero=2: the
    parameters / S plus all of them whole (each block stays gathered from its forward until its
    backward, so at the start of backward every block is); gradients: / S plus one block's whole
    gradient before its reduce-scatter (in `buckets_bytes`, replacing the allreduce buckets). A mixed
    plan: its zero-2 blocks whole, its largest zero-3 block, its replicated blocks whole with their
    gradients and GradSync buckets.
    recompute: a recomputed block keeps only its input for backward; the one block being recomputed
    holds its activations again (the largest recomputed block's); the root's own and the other blocks'
    activations are kept as they are.
    `params` (`fsdp_block_bytes`, composed layouts): per block the bytes FSDP shards and those kept
    replicated; only the former are divided by S and gathered, the latter stay whole with their
    GradSync buckets. None: every parameter of `layers` sharded. Framework and I/O bytes: the caller's."""
    by_block: dict[str, LayerMemory] = {}
    for m, b in zip(layers, owners, strict=True):
        have = by_block.get(b, LayerMemory())
        by_block[b] = LayerMemory(have.weights_bytes + m.weights_bytes, have.grads_bytes + m.grads_bytes,
                                  have.optimizer_bytes + m.optimizer_bytes,
                                  have.activations_bytes + m.activations_bytes, have.buckets_bytes + m.buckets_bytes,
                                  max(have.transient_bytes, m.transient_bytes))
    blocks = {b: m for b, m in by_block.items() if b}
    weights = sum(m.weights_bytes for m in by_block.values())
    grads = sum(m.grads_bytes for m in by_block.values())
    opt = sum(m.optimizer_bytes for m in by_block.values())
    buckets = sum(m.buckets_bytes for m in by_block.values())
    held = weights
    level = (lambda b: zero.get(b, 0)) if isinstance(zero, Mapping) else (lambda b: zero)  # noqa: E731
    if sample > 1 and any(level(b) for b in by_block):
        copies = opt / weights if weights else 0.0
        if params is None:
            params = {b: (m.weights_bytes, 0.0) for b, m in by_block.items()}
        sharded = {b: f for b, (f, _) in params.items() if level(b)}
        whole_rep = sum(f for b, (f, _) in params.items() if not level(b))  # replicated blocks: held whole
        kept = sum(k for _, k in params.values())
        z3 = max((f for b, f in sharded.items() if b and level(b) == 3), default=0.0)
        whole = (z3 + sum(f for b, f in sharded.items() if level(b) == 2)
                 + (sharded.get("", 0.0) if level("") == 3 else 0.0))
        held = grads = sum(sharded.values()) / sample + kept + whole_rep
        opt = held * copies
        weights = held + whole
        # one block's whole gradient before its reduce-scatter; the GradSync buckets of the sharded
        # blocks' kept parameters and of the replicated blocks (all their parameters, the kept ones
        # included: those are not counted twice)
        rep_buckets = sum(m.buckets_bytes for b, m in by_block.items() if not level(b))
        kept_sharded = sum(k for b, (_, k) in params.items() if level(b))
        buckets = max(sharded.values(), default=0.0) + kept_sharded + rep_buckets
    acts = sum(m.activations_bytes for m in by_block.values())
    redo = set(blocks) if recompute == "all" else set() if recompute == "none" else set(recompute) & set(blocks)
    if redo:
        acts = (sum(m.activations_bytes for b, m in by_block.items() if b not in redo)
                + sum(block_inputs.get(b, 0.0) for b in redo) + max(blocks[b].activations_bytes for b in redo))
    transient = max([held * optimizer_step_copies(optimizer, weight_decay),
                     *(m.transient_bytes for m in layers)])
    return RankMemory(framework_bytes=0.0, weights_bytes=weights, grads_bytes=grads, optimizer_bytes=opt,
                      activations_bytes=acts, buckets_bytes=buckets, transient_bytes=transient, io_bytes=0.0)


MEMORY_TOLERANCE = 0.20  # `hybridpar train` warns when a rank's measured peak exceeds the plan's by more


def memory_report(measured_by_rank: Sequence[int | float | None], predicted: RankMemory | float,
                  tolerance: float = MEMORY_TOLERANCE) -> dict:
    """Each rank's measured peak beside the prediction, as `hybridpar train --json` reports it:
    {"predicted_bytes", "predicted_breakdown", "ranks": [{"rank", "peak_bytes", "ratio"}], "worst_ratio",
    "warning"}; `warning` is a sentence when some rank's peak exceeds the prediction by more than
    `tolerance` (else None). Ranks that measured nothing (None) are listed without a ratio."""
    total = predicted.total_bytes if isinstance(predicted, RankMemory) else float(predicted)
    peaks = [None if peak is None else int(peak) for peak in measured_by_rank]
    ratios = [float(peak) / total if peak is not None and total > 0 else None for peak in measured_by_rank]
    ranks = [{"rank": r, "peak_bytes": peak, "ratio": ratio} for r, (peak, ratio) in enumerate(zip(peaks, ratios))]
    worst = max((x for x in ratios if x is not None), default=None)
    warning = None
    if worst is not None and worst > 1 + tolerance:
        over = [r for r, ratio in enumerate(ratios) if ratio is not None and ratio > 1 + tolerance]
        peak = max(peaks[r] or 0 for r in over)
        warning = (f"rank{'s' if len(over) > 1 else ''} {', '.join(map(str, over))} peaked at "
                   f"{peak / 2**30:.2f} GiB, {worst - 1:.0%} over the plan's {total / 2**30:.2f} GiB per rank "
                   f"(tolerance {tolerance:.0%})")
    return {"predicted_bytes": int(total),
            "predicted_breakdown": predicted.breakdown() if isinstance(predicted, RankMemory) else None,
            "ranks": ranks, "worst_ratio": worst, "warning": warning}
