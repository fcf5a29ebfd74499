"""The collectives one training step issues under a layout, per layer: kind, group size and bytes.

This is the analytic twin of hybridpar.parallel (measured CommLog bytes equal these, per kind; a test
checks it). Pure Python on a hybridpar Graph: no torch.distributed. Byte convention as in
hybridpar.cost.collectives: allreduce = the buffer, allgather = the gathered result,
reduce_scatter = the input. Price a list with the collective time functions, e.g.
`allgather_time(op.bytes_, ranks, cluster)` for `op.kind == "allgather"`.

Per layer with layout (sample S, channel P_C, filter P_F), G = P_C*P_F, n = batch/S samples per rank,
boundary tensors split into G channel pieces (uneven: torch.chunk's, as DTensor's Shard):
  conv2d / linear   fwd: allgather x in the filter group (P_F > 1); reduce_scatter y in the channel
                    group (P_C > 1). bwd: allgather dy in the channel group; reduce_scatter dx in the
                    filter group (only if the input needs a gradient). grad: allreduce of the weight
                    (and bias) shard over the S ranks holding it (the segmented allreduce).
  batchnorm         (global statistics, S > 1) fwd: 1 allreduce of 3 C_g + 1 float64 values (count,
                    count*mean, M2, count*mean^2: exact in fp32, constant in S); bwd: 1 allreduce of
                    2 C_g floats; grad: allreduce of the 2 C_g affine
                    parameters. "local" statistics: only the grad allreduce.
  model output      allgather of the channel-split output over the G ranks of a sample group; with
                    whole_outputs (the API's inputs="global": whole outputs on every rank), then of
                    the sample-split output over the S sample groups.
  loss              (hybridpar train, whole_outputs=False) allreduce of the scalar loss over the S
                    sample groups (reporting); gradients are averaged in the segmented allreduce.
  concat            (channels, G > 1) all-to-all in the sample group of the concatenation's parts
                    that other ranks hold, forward and backward.
  redistribution    a conv whose layout has another (S, G) than the plan's default: alltoall of its
                    input into its layout and of its output back, and the inverse in backward; bytes
                    are what this rank sends to other ranks (hybridpar.layout.moved_elements).
  layer / RMS norm  on a channel_filter-split input: DTensor's allgather of the sample group's input
                    over the G ranks, forward (and backward for a layer norm): `norm_gathers`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, replace
from math import prod
from typing import Protocol, TypeVar

from hybridpar.graph.types import Graph, Node
from hybridpar.layout import (
    GridPos,
    Split,
    moved_channels,
    moved_elements,
    received_channels,
)
from hybridpar.layout.halo import SPATIAL_DIMS, Window, coords_of, exchanges, halo_plan, split_dims
from hybridpar.layout.layer import ORDER
from hybridpar.layout.pieces import piece_sizes
from hybridpar.layout.runs import BUCKET_BYTES, DISTRIBUTED_CLASSES, runs_distributed  # noqa: F401 (re-exported)
from hybridpar.plans.schema import LayerLayout, Plan
from hybridpar.plans.strategy import parse_strategy

FP32 = 4


@dataclass(frozen=True)
class CommOp:
    kind: str  # "allreduce" | "allgather" | "reduce_scatter"
    group_size: int
    bytes_: int
    group: str  # "filter" | "channel" | "sample" (the G ranks of a sample group) | "replica"
    phase: str = "fwd"  # "fwd" | "bwd" | "grad" | "loss"


def splits_by_layout(node: Node) -> bool:
    """Whether the runtime runs `node` as a distributed conv/linear under a channel/filter layout (its
    collectives and 1/G compute); otherwise it runs whole on every rank, its parameters replicated.
    The facts are the traced node's `module_class` (graph.build), `groups` and `padding_mode`."""
    return runs_distributed(node.op, node.attr("module_class"), int(node.attr("groups", 1) or 1),
                            node.attr("padding_mode") or "zeros")


RECURRENT_OPS = ("lstm",)  # graph.ops' kind of nn.LSTM/nn.GRU/nn.RNN


def layout_refusal(graph: Graph, layout: LayerLayout | str) -> str | None:
    """Why hybridpar's runtime cannot run `graph` under `layout` (a one-line message), else None:
    a spatial layout the runtime cannot serve (`spatial_refusal`);
    a recurrent layer (nn.LSTM/GRU/RNN) under a channel/filter layout, which the runtime's dry run
    fails inside the layer ("aten.addmm got mixed torch.Tensor and DTensor", torch 2.13). One rule for
    the per-layer planner's strategy and search space, so the API and `hybridpar plan` refuse alike."""
    if isinstance(layout, str):
        layout = parse_strategy(layout).layout
    if layout.spatial > 1:
        return spatial_refusal(graph, layout)
    if layout.channel * layout.filter == 1:
        return None
    rnn = next((n for n in graph.nodes if n.op in RECURRENT_OPS), None)
    if rnn is None:
        return None
    return (f"{layout.to_strategy()}: module '{rnn.module or rnn.name}' is a recurrent layer (nn.LSTM/GRU/RNN), "
            "which hybridpar's runtime cannot run under a channel/filter layout; use a sample-only layout "
            "for this model")


# graph.ops' kinds whose statistics span the spatial pieces (LayerNorm, GroupNorm, InstanceNorm, LRN):
# hybridpar.parallel.styles.spatial_layers.spatial_refusal refuses their modules
SPATIAL_REFUSED_OPS = {"layernorm": "a layer/group/instance norm (its statistics span the spatial pieces)",
                       "lstm": "a recurrent layer", "attention": "attention", "embedding": "an embedding"}


def spatial_refusal(graph: Graph, layout: LayerLayout) -> str | None:
    """Why the runtime cannot run `graph` under the spatial `layout`, from the traced graph alone (the
    planner's twin of hybridpar.parallel.styles.spatial_layers.spatial_refusal, which the dry run
    applies to the modules): a split dim the model does not have, convolutions padded other than
    with zeros, pooling with ceil_mode, normalisations whose statistics span the pieces, and sequence
    layers. Spatial x channel/filter in one layer runs (SpatialDistConv) and is priced
    (search.layers.spatial_plan, `spatial_conv_collectives`' bytes)."""
    from hybridpar.cost.spatial import model_ndim, spatial_dims

    name = layout.to_strategy()
    try:
        spatial_dims(layout, model_ndim(graph))
    except ValueError as err:
        return f"{name}: {err}"
    for n in graph.nodes:
        where = f"module '{n.module or n.name}'"
        why: str | None
        if n.attr("padding_mode") not in (None, "zeros"):
            why = f"a convolution with padding_mode={n.attr('padding_mode')!r} (only zeros padding is exchanged)"
        elif n.op in ("maxpool", "avgpool") and n.attr("ceil_mode"):
            why = "a pooling with ceil_mode=True"
        else:
            why = SPATIAL_REFUSED_OPS.get(n.op)
        if why is not None:
            return f"{name}: {where} is {why}, which cannot run with spatial splits; use a sample-only layout"
    return spatial_cf_refusal(graph, layout)


def spatial_cf_refusal(graph: Graph, layout: LayerLayout) -> str | None:
    """Why a spatial x channel/filter `layout` is refused for `graph`: none of its convolutions is one the
    runtime splits over channel/filter on a spatial piece (SpatialDistConv runs nn.Conv2d only; a
    Conv3d or Conv1d, a grouped conv runs whole, with every channel, on each channel/filter rank), so
    the G ranks of a piece would repeat each convolution, and the planner's figures would price them
    at 1/G. None when G = 1 or some convolution is split."""
    if layout.g_size == 1 or any(n.op == "conv2d" and splits_by_layout(n) for n in graph.nodes):
        return None
    cf = ",".join(f"{k}={getattr(layout, k)}" for k in ("channel", "filter") if getattr(layout, k) > 1)
    return (f"{layout.to_strategy()}: no convolution of this model is split over channel/filter on a spatial "
            f"piece (only nn.Conv2d with groups=1 is); every rank of {cf} would compute each convolution whole: "
            "put those ranks on the spatial or sample dims instead")


def layer_collectives(node: Node, layout: LayerLayout, *, position: int = 0, input_grad: bool = True,
                      in_pieces: list[int] | None = None, bn_stats: str = "global",
                      dtype_bytes: int = FP32) -> list[CommOp]:
    """Collectives `node` issues in one training step on the rank at grid position `position`
    (0..G-1). `node.in_shapes[0][0]` is the global batch. `in_pieces` overrides the split of a
    linear layer's input features (default: its producer's channel pieces, see model_collectives).
    A node the loss does not depend on (graph attr `dead_end`) runs no backward: none of its
    backward collectives, and no gradient for parameters held as replicated DTensors (G > 1);
    a local shard's (split layers, batch norms, any layer of a sample-only layout) is still summed,
    as zeros (runtime.grad_buckets.GradSync: every rank issues the same buckets). A node with
    `grad_summed` False (cost.spatial.local_graph: a Linear head under a spatial layout with one sample
    group, computed alike on every rank) sums no gradient."""
    ops = _layer_collectives(node, layout, position, input_grad, in_pieces, bn_stats, dtype_bytes)
    if node.attr("grad_summed") is False:
        ops = [op for op in ops if op.phase != "grad"]
    if node.attr("dead_end"):
        replicated = layout.channel * layout.filter > 1 and node.op != "batchnorm" and not splits_by_layout(node)
        ops = [op for op in ops if op.phase != "bwd" and not (op.phase == "grad" and replicated)]
    return ops


def _layer_collectives(node: Node, layout: LayerLayout, position: int, input_grad: bool,
                       in_pieces: list[int] | None, bn_stats: str, dtype_bytes: int) -> list[CommOp]:
    if splits_by_layout(node):
        return _matmul_like(node, layout, position, input_grad, in_pieces, dtype_bytes)
    if node.op == "batchnorm":
        return _batchnorm(node, layout, position, input_grad, bn_stats, dtype_bytes)
    if node.params and layout.sample > 1:
        # any other layer with parameters (embedding, LSTM, LayerNorm, attention, a linear the runtime
        # leaves whole, free parameters):
        # replicated on every rank, its gradient summed over the sample groups
        return [CommOp("allreduce", layout.sample, _replicated_grad_numel(node, layout, position) * dtype_bytes,
                       "replica", "grad")]
    return []


SLIDING_OPS = ("conv2d", "conv", "maxpool", "avgpool")  # graph.ops' kinds that halo-exchange when split spatially


def halo_collectives(node: Node, layout: LayerLayout, *, rank: int = 0, input_grad: bool = True,
                     dtype_bytes: int = FP32) -> list[CommOp]:
    """The halo exchanges of a convolution or pooling under a spatial layout (depth/height/width > 1),
    on `rank` (row-major over layout.ORDER): forward, each other rank's window rows this rank holds;
    backward (when the input needs a gradient), those rows' gradients it receives back, summed
    (hybridpar.parallel.styles.spatial, one exchange per split dim; layout.halo's geometry)."""
    if layout.spatial == 1 or node.op not in SLIDING_OPS or node.attr("transposed") or not node.in_shapes:
        return []
    x = node.in_shapes[0]
    nd = len(x) - 2
    degrees = {k: getattr(layout, k) for k in ORDER}
    dims = split_dims(degrees, nd)
    names = SPATIAL_DIMS[3 - nd:]
    coords = coords_of(degrees, rank, ORDER)
    k, s, p, d = (node.attr(a) for a in ("kernel", "stride", "padding", "dilation"))
    windows = {dim: Window(x[dim], k[dim - 2], s[dim - 2], p[dim - 2], d[dim - 2]) for dim, _ in dims}
    lead = piece_sizes(x[0], layout.sample)[coords["sample"]] * _halo_channels(node, layout, rank)
    ops = []
    for dim, parts, fwd, bwd in exchanges(tuple(x[2:]), windows, dict(dims),
                                          {dim: coords[names[dim - 2]] for dim, _ in dims}, lead):
        ops.append(CommOp("halo", parts, fwd * dtype_bytes, names[dim - 2], "fwd"))
        if input_grad:
            ops.append(CommOp("halo", parts, bwd * dtype_bytes, names[dim - 2], "bwd"))
    return ops


def _halo_channels(node: Node, layout: LayerLayout, rank: int) -> int:
    """Channels of the tensor a spatially split op exchanges rows of: under channel/filter too (G > 1)
    pooling runs on this rank's channel piece and so does a distributed conv (its halo before its
    filter-group gather: hybridpar.parallel.styles.spatial_layers.SpatialDistConv); other convs
    gather every channel first."""
    G, c = layout.g_size, node.in_shapes[0][1]
    if G > 1 and (node.op in ("maxpool", "avgpool") or (node.op == "conv2d" and splits_by_layout(node))):
        return _piece(c, G, rank % G)
    return c


def spatial_conv_collectives(node: Node, layout: LayerLayout, *, rank: int = 0, input_grad: bool = True,
                             dtype_bytes: int = FP32) -> list[CommOp]:
    """A distributed conv under spatial x channel/filter (SpatialDistConv) on `rank`: its halo
    exchanges, then the channel/filter rule (`_matmul_like`) on this rank's spatial window: the input's
    window along the split dims (halo and edge padding rows included: the filter group gathers the
    extended piece) and the output's piece; the weight gradient is summed over the sample x spatial
    ranks holding its block."""
    ops = halo_collectives(node, layout, rank=rank, input_grad=input_grad, dtype_bytes=dtype_bytes)
    if layout.spatial == 1 or not splits_by_layout(node) or node.op != "conv2d":
        return ops + _layer_collectives(node, layout, rank % layout.g_size, input_grad, None, "global",
                                        dtype_bytes)
    x, y = node.in_shapes[0], node.out_shape
    degrees = {k: getattr(layout, k) for k in ORDER}
    coords = coords_of(degrees, rank, ORDER)
    k, s, p, d = (node.attr(a) for a in ("kernel", "stride", "padding", "dilation"))
    xs, ys = list(x), list(y)
    for dim, parts in split_dims(degrees, len(x) - 2):
        plan = halo_plan(Window(x[dim], k[dim - 2], s[dim - 2], p[dim - 2], d[dim - 2]), parts)
        me = coords[SPATIAL_DIMS[3 - (len(x) - 2):][dim - 2]]
        a, b = plan.window[me]
        o0, o1 = plan.out_piece(me)
        xs[dim], ys[dim] = b - a, o1 - o0
    local = replace(node, in_shapes=(tuple(xs), *node.in_shapes[1:]), out_shape=tuple(ys))
    cf = [op for op in _matmul_like(local, layout, rank % layout.g_size, input_grad, None, dtype_bytes)
          if op.phase != "grad"]
    stats = layout.sample * layout.spatial
    shard = sum(op.bytes_ for op in _matmul_like(local, LayerLayout(sample=2, channel=layout.channel,
                                                                     filter=layout.filter),
                                                 rank % layout.g_size, input_grad, None, dtype_bytes)
                if op.phase == "grad")
    return ops + cf + ([CommOp("allreduce", stats, shard, "replica", "grad")] if shard else [])


def _replicated_grad_numel(node: Node, layout: LayerLayout, position: int) -> int:
    """Elements of a replicated parameter's gradient this rank sums. A per-channel parameter of an
    elementwise op on a channel-split activation (a layer scale, ConvNeXt-V2's GRN, Dinov2's
    LayerScale) gets its gradient split on channel_filter as the activation is (DTensor: Shard), and
    GradSync sums only this rank's piece over the sample groups (measured: HF convnext, swiftformer,
    dinov2, beit tiny). Approximation, from shapes alone: one parameter, exactly one dim over 1,
    aligned with the activation's last dim or a 4-D activation's dim 1."""
    g = layout.channel * layout.filter
    if g == 1 or node.op not in ("mul", "add") or len(node.param_shapes) != 1 or not node.in_shapes:
        return node.params
    shape, act = node.param_shapes[0][1], node.in_shapes[0]
    if len(act) == 4 and len(shape) >= 2 and shape[0] == act[1] > 1 and not _broadcasts(shape, act):
        # indexed into the activation's trailing dims first (LeViT's attention biases: biases[:, idx]
        # -> [heads, N, N], added to [B, heads, N, N] scores split on heads): dim 0 meets dim 1
        # (measured: HF levit tiny, sample=2,filter=2: 120 B planned over before)
        return node.params // shape[0] * _piece(shape[0], g, position % g)
    full = [i for i, n in enumerate(shape) if n > 1]
    if len(full) != 1 or len(shape) > len(act):
        return node.params
    d, size = len(act) - len(shape) + full[0], shape[full[0]]
    if act[d] != size or not (d == len(act) - 1 or (len(act) == 4 and d == 1)):
        return node.params
    return node.params // size * _piece(size, g, position % g)


def _broadcasts(shape: tuple[int, ...], act: tuple[int, ...]) -> bool:
    """Whether a tensor of `shape` broadcasts against `act` as it is (right-aligned)."""
    return len(shape) <= len(act) and all(a == b or a == 1 for a, b in zip(reversed(shape), reversed(act)))


def whole_conv_gathers(node: Node, layout: LayerLayout, *, input_split: bool = True,
                       dtype_bytes: int = FP32) -> list[CommOp]:
    """A conv the runtime leaves whole (`splits_by_layout` False) under G = P_C*P_F > 1 runs on its
    sample group's whole input: DTensor gathers the channel-split input on channel_filter inside
    hybridpar.parallel.dtensor.rules' convolution handler forward, and again backward for the weight
    gradient (an allgather of the sample group's input, G ranks, each time). None when the input
    arrives whole (`input_split` False: the model's input, a layer left whole, a tensor with an
    empty channel piece). Its output gradient's gather, where the output meets a split one, is
    `whole_grad_gather`'s."""
    G = layout.channel * layout.filter
    if node.op != "conv2d" or splits_by_layout(node) or G == 1 or not input_split:
        return []
    x = node.in_shapes[0]
    nbytes = x[0] // layout.sample * prod(x[1:]) * dtype_bytes
    return [CommOp("allgather", G, nbytes, "sample", "fwd"), CommOp("allgather", G, nbytes, "sample", "bwd")]


def whole_grad_gather(meets: tuple[int, ...], layout: LayerLayout, *, dtype_bytes: int = FP32) -> list[CommOp]:
    """The gather of a whole tensor's gradient: a tensor the runtime holds whole on channel_filter
    (DTensor: Replicate; a whole conv's output, and what elementwise ops, pooling or a mean make of
    it) that needs a gradient and meets a channel-split computation gets its gradient split on
    channel_filter there, and DTensor gathers it (one allgather over the G ranks of a sample group,
    backward) at the shape `meets` (global batch first) of the whole tensor where it met:
      - a split layer (conv/linear/batch norm) takes its channel piece of the whole input (a free
        slice in hybridpar.parallel.dtensor.boundary.to_local): the slice's backward gathers that input
        (a whole conv -> batch norm: the conv's output; -> mean -> linear: the [N, C] mean);
      - an elementwise join with a split operand (a residual add) slices the whole operand inside
        DTensor's op; the split gradient reaches the whole conv, whose backward handler gathers it
        at the conv's output (`meets` = the join's whole input, the conv's output through an
        elementwise chain).
    Measured in the dry run's records (tests/search/test_bytes_grouped_consumer.py). None when G = 1.
    The planner (search.layers.layer_cost) decides where a whole tensor meets a split one."""
    G = layout.channel * layout.filter
    if G == 1 or not meets:
        return []
    return [CommOp("allgather", G, prod(meets) // layout.sample * dtype_bytes, "sample", "bwd")]


def norm_gathers(head: Node, followers: Sequence[Node], layout: LayerLayout, *, head_split: bool,
                 head_grad: bool = True, dtype_bytes: int = FP32) -> list[CommOp]:
    """DTensor's gathers of a layer or RMS norm's input (graph kind "layernorm" normalising the input's
    last dims: 'stat_numel' their product) that arrives split on channel_filter (G > 1), among a
    vertex's `followers`; each an allgather of the sample group's input over the G ranks:
      - a layer norm: torch's aten.native_layer_norm strategy needs the normalised dims whole, so DTensor
        gathers the input forward, and again backward (autograd saved the split input), where the
        backward runs;
      - an RMS norm: DTensor refuses its decomposition on a split input (an in-place add on the
        Partial mean), which hybridpar.parallel.styles.concat serves on the input gathered first
        (a redistribute autograd sees: its backward is a slice): once, forward.
    Their output is whole (the planner's _whole_origins). What is split: `head` (the vertex's node)
    when `head_split`, a split layer's output when its last piece is not empty (else the runtime
    gathered it whole: runtime.dtensors.settle); a follower whose data input (its first) is split,
    and a batch norm's output (it takes its channel piece). `head_grad`: the head's output needs a
    gradient (a weight layer's always). Measured in the dry run's records
    (tests/search/layers/test_bytes_norm_gathers.py). Approximation: the split dim is taken to be among
    the normalised ones (a linear's features; a conv's channels permuted last)."""
    G = layout.channel * layout.filter
    if G == 1 or not head_split or not any(f.op == "layernorm" for f in followers):
        return []
    if head.op in ("linear", "conv2d") and len(head.out_shape) > 1:
        size = head.out_shape[-1] if head.op == "linear" else head.out_shape[1]
        head_split = _piece(size, G, G - 1) > 0
    split, grad = {head.name: head_split}, {head.name: head_grad}
    ops: list[CommOp] = []
    for f in followers:
        src = f.inputs[0] if f.inputs else ""
        in_split, grad[f.name] = split.get(src, False), grad.get(src, False) or f.params > 0
        trailing = {prod(f.in_shapes[0][k:]) for k in range(1, len(f.in_shapes[0]))} if f.in_shapes else set()
        if f.op == "layernorm" and f.attr("stat_numel") in trailing:
            split[f.name] = False
            if in_split:
                nbytes = f.in_shapes[0][0] // layout.sample * prod(f.in_shapes[0][1:]) * dtype_bytes
                ops.append(CommOp("allgather", G, nbytes, "sample", "fwd"))
                if not f.attr("rms") and grad[f.name] and not f.attr("dead_end"):
                    ops.append(CommOp("allgather", G, nbytes, "sample", "bwd"))
        else:
            split[f.name] = f.op == "batchnorm" or in_split
    return ops


def _piece(n: int, p: int, k: int) -> int:
    """piece_sizes(n, p)[k] without the list (torch.chunk's convention)."""
    full = -(-n // p)
    return max(0, min(full, n - k * full))


def _pieces_sum(n: int, p: int, start: int, step: int, count: int) -> int:
    """sum(piece_sizes(n, p)[start + i * step] for i in range(count)) in closed form: pieces
    0 .. n // full - 1 are full, the next holds the remainder, the rest are empty (the planner asks
    for G up to thousands of pieces, thousands of times)."""
    full = -(-n // p)
    if full == 0 or count <= 0:
        return 0
    nfull, rem = divmod(n, full)
    whole = 0 if start >= nfull else min(count, (nfull - 1 - start) // step + 1)
    i, r = divmod(nfull - start, step)
    partial = rem if rem and nfull < p and nfull >= start and r == 0 and i < count else 0
    return whole * full + partial


def _matmul_like(node: Node, lay: LayerLayout, position: int, input_grad: bool, in_pieces: list[int] | None,
                 b: int) -> list[CommOp]:
    S, c, f = lay.sample, lay.channel, lay.filter
    G = c * f
    x, y = node.in_shapes[0], node.out_shape
    n = x[0] // S
    if node.op == "linear":  # features on the last dim; every other dim but the samples is whole
        x, y = (x[0], x[-1], prod(x[1:-1])), (y[0], y[-1], prod(y[1:-1]))
    in_sp, out_sp = (prod(x[2:]) if len(x) > 2 else 1), (prod(y[2:]) if len(y) > 2 else 1)
    ops: list[CommOp] = []
    w_name = next((k for k, _ in node.param_shapes if k.endswith("weight")), None)
    b_name = next((k for k, _ in node.param_shapes if k.endswith("bias")), None)
    shapes = dict(node.param_shapes)
    w_shape = shapes.get(w_name) if w_name is not None else None
    bias_shape = shapes.get(b_name) if b_name is not None else None
    # parameters besides the weight and bias that the tracer gave this node (a free parameter no op
    # reads goes to its module's first node): whole on every rank; under channel/filter layouts they
    # are replicated DTensors that get no gradient, so no allreduce (runtime.grad_buckets.GradSync),
    # in a sample-only layout their zero gradients are summed with the layer's (below: all of shapes).
    # Without a weight, the others are the kernel itself (F.conv2d(x, self.kernel) built by hand)
    others = sum(prod(s) for k, s in node.param_shapes if k not in (w_name, b_name)) if w_name is None else 0
    if G > 1:
        pos = GridPos(c, f, position % G)
        # pieces by formula (the planner asks for G up to thousands: no list of all G pieces); this
        # rank's columns are pieces i*f .. i*f+f-1, its rows pieces j, f+j, ..., (c-1)f+j (GridPos)
        cols = (sum(in_pieces[k] for k in pos.in_piece_ids()) if in_pieces
                else _pieces_sum(x[1], G, pos.i * f, 1, f))
        rows = _pieces_sum(y[1], G, pos.j, f, c)
        if f > 1:
            ops.append(CommOp("allgather", f, n * cols * in_sp * b, "filter", "fwd"))
        if c > 1:
            ops.append(CommOp("reduce_scatter", c, n * rows * out_sp * b, "channel", "fwd"))
            ops.append(CommOp("allgather", c, n * rows * out_sp * b, "channel", "bwd"))
        if f > 1 and input_grad:
            ops.append(CommOp("reduce_scatter", f, n * cols * in_sp * b, "filter", "bwd"))
        k_sp = prod(w_shape[2:]) if w_shape and len(w_shape) > 2 and node.op == "conv2d" else 1
        shard = (rows * cols * k_sp if w_shape else 0) + (_piece(y[1], G, pos.g) if bias_shape else 0) + others
        # a linear's columns are feature pieces already (cols counts features), so k_sp is 1 there
    else:
        shard = sum(prod(s) for s in shapes.values())
    if S > 1 and shard:
        ops.append(CommOp("allreduce", S, shard * b, "replica", "grad"))
    return ops


def _batchnorm(node: Node, lay: LayerLayout, position: int, input_grad: bool, bn_stats: str,
               b: int) -> list[CommOp]:
    S, G = lay.sample, lay.channel * lay.filter
    if S == 1:
        return []
    cg = _piece(node.in_shapes[0][1], G, position % G)
    ops = []
    if bn_stats == "global":  # (count, count*mean, M2, count*mean^2) in float64: parallel/styles/norm.py
        ops.append(CommOp("allreduce", S, (3 * cg + 1) * 8, "replica", "fwd"))
        if input_grad:
            ops.append(CommOp("allreduce", S, 2 * cg * b, "replica", "bwd"))
    if node.param_shapes:
        ops.append(CommOp("allreduce", S, 2 * cg * b, "replica", "grad"))
    return ops


def _layout_for(spec: Plan | LayerLayout, node: Node) -> LayerLayout:
    if isinstance(spec, Plan):
        return spec.layout_of(node.module) if node.module else spec.default_layout
    return spec


def model_collectives(graph: Graph, spec: Plan | LayerLayout, *, position: int = 0, rank: int | None = None,
                      bn_stats: str = "global", dtype_bytes: int = FP32,
                      whole_outputs: bool = False) -> list[tuple[str, CommOp]]:
    """(node name, op) for every collective of one training step of `graph` (global batch =
    graph input batch) on `rank` (default: `position`, a rank of sample group 0), as
    hybridpar.parallel issues them. Layers keep the default layout's grid position rank % G; a conv
    with another (S, G) uses rank % G' and pays the redistributions in and out. With the sample
    dimension sharded (default.zero), FSDP's collectives ("fsdp:<block>", `fsdp_collectives`) replace
    the gradient allreduces of the parameters it holds (`fsdp_replaced`)."""
    default = spec.default_layout if isinstance(spec, Plan) else spec
    S, G = default.sample, default.channel * default.filter
    rank = position if rank is None else rank
    world = S * G
    outer = Split(S, G)
    needs_grad: dict[str, bool] = {}
    succ = graph.successors
    out: list[tuple[str, CommOp]] = []
    for node in graph.nodes:
        needs_grad[node.name] = node.op != "input" and (
            bool(node.param_shapes) or any(needs_grad.get(i, False) for i in node.inputs))
        if node.op == "input":
            continue
        lay = _layout_for(spec, node)
        own = Split(lay.sample, lay.channel * lay.filter)
        if node.op != "conv2d" or own == outer:
            lay, own = (default, outer) if node.op == "batchnorm" else (lay, outer)
        input_grad = any(needs_grad.get(i, False) for i in node.inputs)
        pieces = None  # a linear's input features are split as its DTensor input is: G chunks
        if own != outer:
            out += [(node.name, op) for op in _redistributions(node, outer, own, rank, world, input_grad,
                                                              dtype_bytes)]
        if node.op == "concat" and G > 1:
            out += [(node.name, op) for op in channel_concat(node, S, G, rank % G, input_grad, dtype_bytes)]
        replaced = fsdp_replaced(node, default)  # FSDP reduce-scatters these gradients instead (below)
        for op in layer_collectives(node, lay, position=rank % own.g_size, input_grad=input_grad,
                                    in_pieces=pieces, bn_stats=bn_stats, dtype_bytes=dtype_bytes):
            if not (replaced and op.phase == "grad"):
                out.append((node.name, op))
    out += [(f"fsdp:{block}", op) for block, op in fsdp_collectives(graph, default, position=rank % G,
                                                                   dtype_bytes=dtype_bytes)]
    outputs = [n for n in graph.nodes if n.op not in ("input", "output") and not succ.get(n.name)]
    for node in outputs:  # channels gathered in the sample group (each group's samples' outputs whole)
        whole = prod(node.out_shape) * dtype_bytes
        if G > 1:
            out.append((node.name, CommOp("allgather", G, whole // S, "sample", "fwd")))
        if S > 1 and whole_outputs:  # the API's global form: then over the sample groups
            out.append((node.name, CommOp("allgather", S, whole, "replica", "fwd")))
    if S > 1 and not whole_outputs:  # hybridpar train: each group's mean loss, allreduced to report it
        out.append(("loss", CommOp("allreduce", S, FP32, "replica", "loss")))
    return out


def channel_concat(node: Node, S: int, G: int, g: int, input_grad: bool, b: int) -> list[CommOp]:
    """torch.cat along channels of channel-split inputs: an all-to-all in the sample group moving the
    parts of the concatenation's piece that other ranks hold (hybridpar.parallel.styles.concat)."""
    ins = node.in_shapes
    if len(ins) < 2 or len(node.out_shape) < 2 or sum(s[1] for s in ins) != node.out_shape[1] \
            or any(s[2:] != node.out_shape[2:] for s in ins):
        return []
    c_sizes, per_chan = [s[1] for s in ins], (ins[0][0] // S) * prod(node.out_shape[2:]) * b
    ops = [CommOp("alltoall", G, moved_channels(c_sizes, G, g) * per_chan, "sample", "fwd")]
    if input_grad:  # backward sends the parts of this rank's piece that others hold
        ops.append(CommOp("alltoall", G, received_channels(c_sizes, G, g) * per_chan, "sample", "bwd"))
    return ops


def _redistributions(node: Node, outer: Split, own: Split, rank: int, world: int, input_grad: bool,
                     b: int) -> list[CommOp]:
    x, y = node.in_shapes[0], node.out_shape
    def moved(shape: tuple[int, ...], src: Split, dst: Split) -> int:
        return moved_elements(shape[0], shape[1], prod(shape[2:]), src, dst, rank, world) * b
    ops = [CommOp("alltoall", world, moved(x, outer, own), "world", "fwd"),
           CommOp("alltoall", world, moved(y, own, outer), "world", "fwd"),
           CommOp("alltoall", world, moved(y, outer, own), "world", "bwd")]
    if input_grad:
        ops.append(CommOp("alltoall", world, moved(x, own, outer), "world", "bwd"))
    return ops


class _Transfer(Protocol):
    """What bytes_by_kind reads: a CommOp, or a runtime's record of one (parallel.comm.log.CommRecord)."""

    @property
    def kind(self) -> str: ...

    @property
    def bytes_(self) -> int: ...


def bytes_by_kind(ops: Iterable[_Transfer | tuple[object, _Transfer]]) -> dict[str, int]:
    """Total bytes per collective kind of `ops` (CommOps or (name, CommOp) pairs)."""
    totals: dict[str, int] = {}
    for item in ops:
        op = item[1] if isinstance(item, tuple) else item
        totals[op.kind] = totals.get(op.kind, 0) + op.bytes_
    return dict(sorted(totals.items()))


# -- gradient buckets (hybridpar.parallel.comm.grad_sync.GradSync's rule, priced by the planner) ------

def grad_ready_bytes(node: Node, layout: LayerLayout, *, position: int = 0, in_pieces: list[int] | None = None,
                     dtype_bytes: int = FP32) -> list[int]:
    """Bytes of `node`'s parameter gradients on the rank at grid `position`, in the order backward
    makes them ready: a split layer's bias before its weight (the runtime adds the bias after the
    distributed convolution), a whole layer's in torch's order (nn.Linear: bias, weight, as addmm
    takes them; nn.Conv2d: weight, bias). Only gradients the runtime sums over sample groups (S > 1)
    count: none otherwise."""
    if layout.sample == 1:
        return []
    ops = [op for op in layer_collectives(node, layout, position=position, in_pieces=in_pieces,
                                          dtype_bytes=dtype_bytes) if op.phase == "grad"]
    if not ops:
        return []
    total = sum(op.bytes_ for op in ops)
    if node.op == "batchnorm":  # weight and bias: one piece of channels each
        return [total // 2, total - total // 2]
    bias = next((s for k, s in node.param_shapes if k.endswith("bias")), None)
    if node.op in ("conv2d", "linear") and bias:
        g = layout.channel * layout.filter
        b = _piece(bias[0], g, position % g) * dtype_bytes if g > 1 else prod(bias) * dtype_bytes
        if not 0 < b < total:
            return [total]
        return [total - b, b] if g == 1 and node.op == "conv2d" else [b, total - b]
    return [total]


_Key = TypeVar("_Key", bound=Hashable)


def bucket_schedule(ready: Sequence[tuple[_Key, int]], bucket_bytes: int = BUCKET_BYTES) -> list[tuple[_Key, int, int]]:
    """GradSync's buckets for gradients that become ready in the order of `ready`, a sequence of
    (group key, bytes): one open bucket per group; a gradient joins its group's bucket, which is
    launched the moment it holds >= bucket_bytes; at the end of backward the open buckets launch in
    the order they were opened. Returns (key, bytes, i) per launch in launch order, i the index of the
    gradient after which it launched (len(ready) for the end of backward)."""
    open_: dict[_Key, int] = {}
    out: list[tuple[_Key, int, int]] = []
    n = 0
    for n, (key, nbytes) in enumerate(ready):
        open_[key] = open_.get(key, 0) + nbytes
        if open_[key] >= bucket_bytes:
            out.append((key, open_.pop(key), n))
    end = len(ready)
    out += [(key, b, end) for key, b in open_.items()]
    return out


def fsdp_pieces(node: Node, layout: LayerLayout, position: int = 0) -> list[tuple[int, ...]]:
    """Shapes of the parameters of `node` that FSDP2 shards over the sample ranks on the rank at grid
    position `position` (hybridpar.parallel.fsdp._shard): under a sample-only layout every parameter
    whole; under channel/filter this rank's local pieces of a split conv/linear (weight rows x cols as
    `_matmul_like` cuts them, bias piece g) and of a batch norm (channel piece g). Every other parameter
    under channel/filter is a replicated DTensor that stays with GradSync (its "grad" allreduce in
    `layer_collectives`), as are a split layer's extra parameters (replicated DTensors): [] for those."""
    G = layout.channel * layout.filter
    if G == 1:
        return [tuple(shape) for _, shape in node.param_shapes]
    g = position % G
    if node.op == "batchnorm":
        return [(_piece(shape[0], G, g),) for _, shape in node.param_shapes if shape]
    if not splits_by_layout(node):
        return []
    pos = GridPos(layout.channel, layout.filter, g)
    x, y = node.in_shapes[0], node.out_shape
    if node.op == "linear":  # features on the last dim
        x, y = (x[0], x[-1]), (y[0], y[-1])
    out: list[tuple[int, ...]] = []
    for name, shape in node.param_shapes:
        if name.endswith("weight"):  # [out rows, in cols, *kernel]: the pieces _matmul_like prices
            rows = _pieces_sum(y[1], G, pos.j, layout.filter, layout.channel)
            cols = _pieces_sum(x[1], G, pos.i * layout.filter, 1, layout.filter)
            out.append((rows, cols, *(shape[2:] if node.op == "conv2d" else ())))
        elif name.endswith("bias"):
            out.append((_piece(y[1], G, g),))
    return out


def fsdp_replaced(node: Node, layout: LayerLayout) -> bool:
    """Whether FSDP2 (layout.zero, S > 1) synchronises `node`'s parameter gradients instead of
    GradSync's "grad" allreduce: every layer under a sample-only layout; split conv/linear layers and
    batch norms under channel/filter (their local pieces, `fsdp_pieces`)."""
    if not layout.zero or layout.sample == 1 or not node.param_shapes:
        return False
    return layout.channel * layout.filter == 1 or node.op == "batchnorm" or splits_by_layout(node)


def fsdp_numel(graph: Graph, layout: LayerLayout, *, position: int = 0, padded: bool = True) -> dict[str, int]:
    """Elements per block (hybridpar.cost.memory.block_of; "" the root's own) that FSDP2 shards on the
    rank at `position`, whole (the all-gather's result); `padded`: each piece's dim 0 rounded up to a
    multiple of S (FSDP2's even shards, what it sends), else as held. Blocks with none are left out."""
    from hybridpar.cost.memory import block_of

    s = layout.sample
    per_block: dict[str, int] = {}
    for node in graph.nodes:
        if not fsdp_replaced(node, layout):
            continue
        pieces = fsdp_pieces(node, layout, position)
        numel = sum((-(-shape[0] // s) * s if padded else shape[0]) * prod(shape[1:]) if shape else
                    (s if padded else 1) for shape in pieces)
        if numel:
            key = block_of(node.module or "")
            per_block[key] = per_block.get(key, 0) + numel
    return per_block


def fsdp_collectives(graph: Graph, layout: LayerLayout, *, position: int = 0,
                     dtype_bytes: int = FP32) -> list[tuple[str, CommOp]]:
    """(block, collective) per step when the sample dimension shards the parameters (`layout.zero`,
    FSDP2 over the S sample ranks; hybridpar.parallel.fsdp) on the rank at grid position `position`:
    per block (hybridpar.cost.memory.block_of; "" the root's own parameters), the all-gather of the
    parameters FSDP holds there (`fsdp_pieces`: all of them under sample-only layouts, the local pieces
    of split layers and batch norms under channel/filter) in forward, again in backward under zero=3
    (not for the root's own: FSDP2 keeps the root gathered), and the reduce-scatter of their gradients.
    These replace the "grad" allreduces of `layer_collectives` for those nodes (`fsdp_replaced`;
    model_collectives drops them); the batch-norm statistics, the output gather and the replicated
    DTensors' allreduces stay. Bytes: each piece's dim 0 padded to a multiple of S (FSDP2's even
    shards), the gathered result / the reduce-scatter input. Empty for zero=0 or S=1."""
    s = layout.sample
    if not layout.zero or s == 1:
        return []
    ops: list[tuple[str, CommOp]] = []
    for key, numel in fsdp_numel(graph, layout, position=position).items():
        nbytes = numel * dtype_bytes
        ops.append((key, CommOp("allgather", s, nbytes, "replica", "fwd")))
        if layout.zero == 3 and key:
            ops.append((key, CommOp("allgather", s, nbytes, "replica", "bwd")))
        ops.append((key, CommOp("reduce_scatter", s, nbytes, "replica", "grad")))
    return ops
