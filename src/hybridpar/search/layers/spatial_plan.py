"""Spatial layouts (depth/height/width splits with halo exchange, times sample) in the per-layer
planner: priced with the planner's own simulator, offered beside its sample/channel/filter plans.

The runtime runs a spatial layout only uniformly (the whole model under one
`sample=S,height=H,...[,channel=C|filter=F]` layout; per-layer mixing is refused), so the candidates
are the uniform spatial layouts the runtime can run, as the planner already adds its uniform layouts.
One is priced on one rank's view of the graph (hybridpar.cost.spatial.local_graph: activations at the
rank's spatial piece, each convolution's and pooling's input window copied and kept, B/S samples,
gradients and batch-norm statistics summed over all S x P ranks) as the layout S x P (x C x F:
`proxy_layout`, each split conv's channel/filter collectives on its window as SpatialDistConv runs
them), with each sliding op's halo exchanges (cost.layout_comm.halo_collectives' bytes,
point-to-point on the cluster's links: cost.spatial.halo_cost) added to its layer's forward and
backward communication, and what the proxy prices otherwise than the runtime runs it corrected
(`evaluate_spatial`: the output's gathers, global average pooling, adaptive pools run on the
gathered input, layers DTensor runs whole).
The plan's notes say which layers go spatial and why (time or memory), or
why the best spatial layout lost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod

from hybridpar.cost.collectives import CommOp
from hybridpar.cost.compute import channels_last_layout
from hybridpar.cost.layout_comm import layout_refusal, spatial_cf_refusal, splits_by_layout
from hybridpar.cost.memory import kept_activations
from hybridpar.cost.spatial import (
    SLIDING,
    backward_moves,
    gather_moves,
    gathered,
    halo_cost,
    local_graph,
    model_ndim,
    proxy_layout,
    spatial_dims,
)
from hybridpar.errors import InfeasibleError, UserError
from hybridpar.layout.halo import SPATIAL_DIMS
from hybridpar.plans import LayerLayout, Plan, Prediction
from hybridpar.search.layers.decomposition import divisors
from hybridpar.search.layers.layer_cost import CostContext
from hybridpar.search.layers.layer_graph import LayerGraph, build_layer_graph
from hybridpar.search.layers.sp_dp import INF


@dataclass(frozen=True)
class SpatialEval:
    """One uniform spatial layout priced: its rank's layer graph and context, options, prediction."""

    layout: LayerLayout
    lg: LayerGraph
    ctx: CostContext
    opts: list
    pred: Prediction
    breakdown: object
    halo_s: float
    sliding: tuple[str, ...]  # the modules that exchange halos (convolutions, pooling)

    @property
    def choice(self) -> list[int]:
        return [0] * len(self.opts)


def _factorisations(p: int, k: int) -> list[tuple[int, ...]]:
    """Ordered k-tuples of positive integers with product p."""
    if k == 1:
        return [(p,)]
    return [(d, *rest) for d in divisors(p) for rest in _factorisations(p // d, k - 1)]


def _splits(p: int, k: int) -> list[tuple[int, ...]]:
    """The splits of p ranks over k dims the planner prices: all of one dim, and the most even ones
    (each costs one pricing of the whole model; halos grow with a piece's surface, so the even
    splits send the least, the one-dim ones exchange along one dim only)."""
    every = _factorisations(p, k)
    one = [t for t in every if sorted(t)[:-1] == [1] * (k - 1)]
    spread = min(max(t) / min(t) for t in every)
    return sorted(set(one) | {t for t in every if max(t) / min(t) == spread}, reverse=True)


def _largest_sizes(graph, nd: int) -> tuple[int, ...]:
    """Per spatial dim, the largest size a sliding op's input has (the model input's, mostly). A dim cut
    into more pieces than that leaves ranks without a row in every layer, and its rank 0 the one-row
    pieces of a cut into that many: the search does not price those (one such evaluation took ~50 s,
    ResNet-50 at height=1024: halo plans over 1,024 pieces); `--strategy` still does, and the runtime
    runs them. Pieces that run out in later layers (a 32^3 CosmoFlow's last pooling to 1^3 under
    depth=2) are the runtime's empty pieces, priced as it runs them, not a reason to drop the split."""
    sizes = [n.in_shapes[0][2:] for n in graph.nodes
             if n.op in SLIDING and n.in_shapes and len(n.in_shapes[0]) == 2 + nd]
    return tuple(max(s[i] for s in sizes) for i in range(nd)) if sizes else (1,) * nd


# graph.ops kinds whose moves under spatial x channel/filter the planner leaves to the dry run (DTensor
# gathers a transposed conv's channels, and a concatenation's split parts next to a whole one):
# api.with_redistributions adds them to a fixed layout's prediction, the search cannot see them
_CF_UNPRICED = ("conv", "concat")


def _cf_unpriced_note(graph, layout: LayerLayout) -> list[str]:
    """What the planner's figures leave out of a spatial x channel/filter `layout` (_CF_UNPRICED), as
    a note (none when nothing is)."""
    def listed(op: str) -> str:
        mods = sorted({n.module or n.name for n in graph.nodes if n.op == op})
        return ", ".join(mods[:4]) + (" ..." if len(mods) > 4 else "") if mods else ""

    convs, cats = listed("conv"), listed("concat")
    parts = ([f"the convolutions {convs} (transposed, 1-D or 3-D: each channel/filter rank computes them whole, "
              f"with every channel) are priced at 1/{layout.g_size} of their channels, compute and activations, "
              "and DTensor's gathers of their inputs are not priced"] if convs else []) + \
        ([f"DTensor's moves around the concatenations {cats} are not priced"] if cats else [])
    if not parts:
        return []
    return ["spatial x channel/filter: " + "; ".join(parts) + " (the step time is low by those; the dry run's "
            "records, below when it runs, hold the moves); the search does not offer this layout for this model"]


def _cf_searched(graph, nd: int) -> bool:
    """Whether the search offers spatial x channel/filter for `graph`: a 2-D model (SpatialDistConv is
    Conv2d's) with convolutions the runtime splits and none of the ops in _CF_UNPRICED (a U-Net's
    transposed convolutions and skip concatenations: `--strategy` still prices it)."""
    return nd == 2 and any(n.op == "conv2d" and splits_by_layout(n) for n in graph.nodes) \
        and not any(n.op in _CF_UNPRICED for n in graph.nodes)


# the largest channel or filter group the search puts on a spatial piece: each candidate is a full
# evaluation, and every group size doubled the spatial candidates of a 1,024-GPU plan (~6 s more per
# ResNet plan); larger groups are priced when asked (--strategy). The search's budget, not a limit of
# the runtime.
MAX_CF_ON_SPATIAL = 4


def _smallest_sizes(graph, nd: int) -> tuple[int, ...]:
    """Per spatial dim, the smallest size a sliding op's output has: a dim cut into more pieces than
    that leaves some ranks an empty piece in the last layers."""
    sizes = [n.out_shape[2:] for n in graph.nodes if n.op in SLIDING and len(n.out_shape) == 2 + nd]
    return tuple(min(s[i] for s in sizes) for i in range(nd)) if sizes else (1,) * nd


def spatial_layouts(graph, gpus: int, batch: int) -> list[LayerLayout]:
    """The uniform sample x spatial (x channel or filter) layouts of `gpus` ranks the runtime can run
    for `graph` at `batch` (at least 2 spatial ranks; the ranks left over after sample x spatial split
    each piece's channels or filters, for a 2-D model with convolutions the runtime splits), excluding
    those cost.layout_comm.layout_refusal refuses. Those whose pieces stay non-empty in every layer
    (no dim cut into more pieces than its smallest sliding-op output has rows) when there are any;
    else those with pieces empty in late layers, as the runtime runs them (a 32^3 CosmoFlow pooled to
    1^3 under depth=2), never cutting a dim into more pieces than it has rows anywhere
    (_largest_sizes). Why not both always: the second kind leaves ranks idle in the last layers and is
    not chosen where the first kind exists in the cases tried, while pricing it doubled the time of
    `make run`'s plan (ResNet-50 x8 wide on 256 GPUs: 4.2-5.6 s -> 10.7 s)."""
    nd = model_ndim(graph)
    if not 1 <= nd <= 3:
        return []
    within = _spatial_layouts(graph, gpus, batch, nd, _smallest_sizes(graph, nd))
    return within or _spatial_layouts(graph, gpus, batch, nd, _largest_sizes(graph, nd))


def _spatial_layouts(graph, gpus: int, batch: int, nd: int, largest: tuple[int, ...]) -> list[LayerLayout]:
    names = SPATIAL_DIMS[3 - nd:]
    cf = _cf_searched(graph, nd)
    out = []
    for s in divisors(gpus):
        if batch % s or gpus // s == 1:
            continue
        for p in divisors(gpus // s):
            g = gpus // (s * p)
            if p == 1 or (g > 1 and not cf) or g > MAX_CF_ON_SPATIAL:
                continue
            for degrees in _splits(p, nd):
                if not all(d <= m for d, m in zip(degrees, largest)):
                    continue
                for extra in ([{}] if g == 1 else [{"channel": g}, {"filter": g}]):
                    lay = LayerLayout(sample=s, **dict(zip(names, degrees)), **extra)
                    if layout_refusal(graph, lay) is None:
                        out.append(lay)
    return out


def _with_halo(vo, nodes: Sequence[str], originals: dict, lay: LayerLayout, ctx: CostContext, inputs: set[str]):
    """`vo` with the halo exchanges of its `nodes` (original, global-shape nodes by name) added to its
    cost's forward and backward communication and bytes (kind "halo"), and the spatial runtime's own
    work per exchanging op (`CostContext.spatial_op_overhead`) to its compute."""
    fwd = bwd = 0.0
    nbytes = exchanging = 0
    for name in nodes:
        n = originals.get(name)
        if n is None or n.op not in SLIDING:
            continue
        f, b, fb, bb = halo_cost(n, lay, ctx.cluster, ctx.elem)
        exchanging += fb > 0
        if n.inputs and n.inputs[0] in inputs:  # the model's input needs no gradient: no backward halo
            b, bb = 0.0, 0
        fwd, bwd, nbytes = fwd + f, bwd + b, nbytes + fb + bb
    if not nbytes:
        return vo, 0.0
    of, ob = ctx.spatial_op_overhead()
    c = vo.costs[0]
    c = dataclasses.replace(c, comm_fwd_s=c.comm_fwd_s + fwd, comm_bwd_s=c.comm_bwd_s + bwd,
                            fwd_s=c.fwd_s + exchanging * of, bwd_s=c.bwd_s + exchanging * ob,
                            comm_bytes={**c.comm_bytes, "halo": c.comm_bytes.get("halo", 0) + nbytes})
    return dataclasses.replace(vo, costs=(c, *vo.costs[1:])), fwd + bwd


def _with_output_gather(vo, lg: LayerGraph, graph, lay: LayerLayout, ctx: CostContext):
    """`vo` (the last vertex) with the gathers of each spatially split model output (the runtime hands
    the loss whole outputs: a U-Net's per-pixel logits; parallel.dtensor.boundary.gather_output):
    DTensor's allgather over the spatial ranks of each sample group, of this rank's channel piece
    (all channels when G = 1 or the output is held whole on channel_filter), then, when G > 1, our
    gather over the channel pieces of the spatially whole output, where the proxy's step extras
    (planner._step_extras) priced the gather of the spatial piece only: the difference is added.
    Bytes: the gathered results. The spatial gather is listed in the cost's dtensor_moves, so the
    dry run's record of it (api.with_redistributions) is not added again."""
    from hybridpar.layout import piece_sizes
    from hybridpar.search.layers.planner import _output_whole

    nd = model_ndim(graph)
    s, p, g = lay.sample, lay.spatial, lay.g_size
    outs = [graph.node(o) for o in graph.outputs if len(graph.node(o).out_shape) == 2 + nd]
    if not outs:
        return vo
    split_channels = g > 1 and not _output_whole(lg)
    whole = sum(graph.batch // s * prod(n.out_shape[1:]) for n in outs) * ctx.elem
    mine = sum(graph.batch // s * (piece_sizes(n.out_shape[1], g)[0] if split_channels else n.out_shape[1])
               * prod(n.out_shape[2:]) for n in outs) * ctx.elem
    ops = [CommOp.placed("allgather", "fwd", mine, _spatial_groups(lay), "spatial", lay)]
    t = ctx.comm_time(ops[0])
    extra = 0
    if split_channels:  # the channel gather of the whole output, less the piece's the proxy priced
        cf = tuple(tuple(range(i * g, (i + 1) * g)) for i in range(s * p))
        full = CommOp.placed("allgather", "fwd", whole, cf, "sample", lay)
        lead = sum(lg.graph.batch // (s * p) * prod(lg.graph.node(o.name).out_shape[1:]) for o in outs) * ctx.elem
        priced = CommOp.placed("allgather", "fwd", lead, cf, "sample", proxy_layout(lay))
        t += max(0.0, ctx.comm_time(full) - ctx.comm_time(priced))
        extra = whole - lead
    c = vo.costs[0]
    c = dataclasses.replace(c, comm_fwd_s=c.comm_fwd_s + t,
                            comm_bytes={**c.comm_bytes, "allgather": c.comm_bytes.get("allgather", 0) + mine + extra},
                            dtensor_moves=(*c.dtensor_moves, ("allgather", p, mine)))
    return dataclasses.replace(vo, costs=(c, *vo.costs[1:]))


def _whole_conv_gather(vo, local, lay: LayerLayout, ctx: CostContext):
    """A conv the runtime leaves whole (grouped, depthwise) under spatial x channel/filter: SpatialConv
    takes every channel, DTensor's allgather on channel_filter of the input's spatial piece, before
    its halo exchange, once (autograd keeps the gathered piece for the weight gradient). The
    proxy priced cost.layout_comm.whole_conv_gathers on its input window, forward and backward:
    those are replaced by that one gather, listed in the cost's dtensor_moves (the dry run's record
    of it is then not added again: api.with_redistributions)."""
    from hybridpar.cost.layout_comm import whole_conv_gathers
    from hybridpar.search.layers.layer_cost import _groups_of

    node = vo.vertex.node
    if not vo.vertex.is_weight or node.op != "conv2d" or splits_by_layout(node) or not node.inputs:
        return vo
    proxy = proxy_layout(lay)
    c = vo.costs[0]
    priced = whole_conv_gathers(node, proxy, dtype_bytes=ctx.elem)
    groups, key = _groups_of("sample", proxy)
    placed = [CommOp.placed(op.kind, op.phase, op.bytes_, groups, op.group, key) for op in priced]
    if c.comm_bytes.get("allgather", 0) < sum(op.bytes_ for op in placed):  # its input arrived whole
        return vo
    halo = local.by_name.get(node.inputs[0])
    piece = halo.in_shapes[0] if halo is not None and halo.attr("halo") else node.in_shapes[0]
    mine = CommOp.placed("allgather", "fwd", piece[0] // proxy.sample * prod(piece[1:]) * ctx.elem, groups,
                         "sample", key)
    fwd = sum(ctx.comm_time(op) for op in placed if op.phase == "fwd")
    bwd = sum(ctx.comm_time(op) for op in placed if op.phase == "bwd")
    nbytes = c.comm_bytes["allgather"] - sum(op.bytes_ for op in placed) + mine.bytes_
    c = dataclasses.replace(c, comm_fwd_s=c.comm_fwd_s - fwd + ctx.comm_time(mine), comm_bwd_s=c.comm_bwd_s - bwd,
                            comm_bytes={**c.comm_bytes, "allgather": nbytes},
                            dtensor_moves=(*c.dtensor_moves, ("allgather", mine.group_size, mine.bytes_)))
    return dataclasses.replace(vo, costs=(c, *vo.costs[1:]))


def _with_spatial_sums(vo, names: Sequence[str], originals: dict, lay: LayerLayout, ctx: CostContext):
    """`vo` with the allreduce of each global average pooling among its `nodes` over the spatial ranks
    of its sample group (SpatialGlobalAvgPool: [B/S, this rank's channel piece, 1 along each split
    dim, the unsplit dims whole], forward only; its backward passes the gradient through)."""
    from hybridpar.layout import piece_sizes

    nbytes, t = 0, 0.0
    for name in names:
        n = originals.get(name)
        # an nn.AdaptiveAvgPoolNd module (the trace records no class for pools: a module's node, not
        # an adaptive max pool's; a functional call inside a module's forward would be taken too)
        if n is None or n.op != "adaptive_avgpool" or n.attr("max") or not n.module or not n.in_shapes:
            continue
        x = n.in_shapes[0]
        nd = len(x) - 2
        split = {d for d, _ in spatial_dims(lay, nd)}
        if not split or gathered(n, lay):
            continue  # another adaptive pool: SpatialGathered (_with_spatial_gathers)
        keep = prod(1 if d in split else x[d] for d in range(2, len(x)))
        b = x[0] // lay.sample * piece_sizes(x[1], lay.g_size)[0] * keep * ctx.elem
        groups = _spatial_groups(lay)
        op = CommOp.placed("allreduce", "fwd", b, groups, "spatial", lay)
        nbytes, t = nbytes + b, t + ctx.comm_time(op)
    if not nbytes:
        return vo
    c = vo.costs[0]
    c = dataclasses.replace(c, comm_fwd_s=c.comm_fwd_s + t,
                            comm_bytes={**c.comm_bytes, "allreduce": c.comm_bytes.get("allreduce", 0) + nbytes})
    return dataclasses.replace(vo, costs=(c, *vo.costs[1:]))


def _with_spatial_gathers(vo, names: Sequence[str], originals: dict, lay: LayerLayout, ctx: CostContext):
    """`vo` with DTensor's allgathers of the input of each op among its `names` that the runtime runs
    on the spatially whole input on every spatial rank (cost.spatial.gathered: SpatialGathered, e.g.
    an adaptive pool to 4^3 before a flatten, a bilinear upsampling), forward (their backward slices
    the gradient), and in backward those of the output's gradient where the next layers split the
    whole output again (cost.spatial.regathered: a U-Net's upsampling): one per split mesh dim, over
    the ranks along it (cost.spatial.gather_moves' and backward_moves' bytes). Listed in the cost's
    dtensor_moves, so the dry run's records of them are not added again (api.with_redistributions).
    Under channel/filter too (G > 1) the pieces' channel placements vary with the layers around: left
    to the dry run's records, which that path adds."""
    if lay.g_size > 1:
        return vo
    dims = list(reversed([k for k in SPATIAL_DIMS if getattr(lay, k) > 1]))
    moves = [(phase, dim, size, nbytes) for name in names if (n := originals.get(name)) is not None
             for phase, got in (("fwd", gather_moves(n, lay, ctx.elem) if gathered(n, lay) else []),
                                ("bwd", backward_moves(n, lay, ctx.elem)))
             for dim, (size, nbytes) in zip(dims, got)]
    if not moves:
        return vo
    t = {ph: sum(ctx.comm_time(CommOp.placed("allgather", ph, b, _dim_groups(lay, dim), "spatial", lay))
                 for p, dim, _, b in moves if p == ph) for ph in ("fwd", "bwd")}
    c = vo.costs[0]
    c = dataclasses.replace(c, comm_fwd_s=c.comm_fwd_s + t["fwd"], comm_bwd_s=c.comm_bwd_s + t["bwd"],
                            comm_bytes={**c.comm_bytes,
                                        "allgather": c.comm_bytes.get("allgather", 0) + sum(m[3] for m in moves)},
                            dtensor_moves=(*c.dtensor_moves, *(("allgather", size, b) for _, _, size, b in moves)))
    return dataclasses.replace(vo, costs=(c, *vo.costs[1:]))


def _dim_groups(lay: LayerLayout, name: str) -> tuple[tuple[int, ...], ...]:
    """The groups of ranks along mesh dim `name` (the others' coordinates fixed; rank order: layout.ORDER)."""
    from hybridpar.layout.layer import ORDER

    deg = getattr(lay, name)
    stride = prod(getattr(lay, k) for k in ORDER[ORDER.index(name) + 1:])
    world = prod(getattr(lay, k) for k in ORDER)
    return tuple(tuple(r + j * stride for j in range(deg)) for r in range(world) if (r // stride) % deg == 0)


def _spatial_groups(lay: LayerLayout) -> tuple[tuple[int, ...], ...]:
    """The spatial ranks of each sample group and channel position (rank order: layout.ORDER)."""
    s, p, g = lay.sample, lay.spatial, lay.g_size
    return tuple(tuple(i * p * g + j * g + k for j in range(p)) for i in range(s) for k in range(g))


def _no_concat_rule(vo, lay: LayerLayout, ctx: CostContext):
    """A concatenation under spatial x channel/filter runs through DTensor (its moves are the dry run's
    records, api.with_redistributions), not hybridpar.parallel.styles.concat's all-to-all, which the
    proxy priced (cost.layout_comm.channel_concat): that is taken out."""
    from hybridpar.cost.layout_comm import channel_concat
    from hybridpar.search.layers.layer_cost import _groups_of

    node, c = vo.vertex.node, vo.costs[0]
    if vo.vertex.is_weight or node.op != "concat" or not c.comm_bytes.get("alltoall"):
        return vo
    proxy = proxy_layout(lay)
    groups, key = _groups_of("sample", proxy)
    ops = [CommOp.placed(op.kind, op.phase, op.bytes_, groups, op.group, key)
           for op in channel_concat(node, proxy.sample, lay.g_size, 0, vo.vertex.input_grad, ctx.elem)]
    fwd = sum(ctx.comm_time(op) for op in ops if op.phase == "fwd")
    bwd = sum(ctx.comm_time(op) for op in ops if op.phase == "bwd")
    left = c.comm_bytes["alltoall"] - sum(op.bytes_ for op in ops)
    comm = {k: v for k, v in {**c.comm_bytes, "alltoall": left}.items() if v}
    c = dataclasses.replace(c, comm_fwd_s=max(0.0, c.comm_fwd_s - fwd), comm_bwd_s=max(0.0, c.comm_bwd_s - bwd),
                            comm_bytes=comm)
    return dataclasses.replace(vo, costs=(c, *vo.costs[1:]))


def evaluate_spatial(s, lay: LayerLayout, grad_sync: str, contexts: dict | None = None) -> SpatialEval:
    """Price the uniform spatial layout `lay` for the planner's setup `s` (planner._Setup) with the
    planner's simulator (planner.predict_with_breakdown). `contexts`: CostContexts by spatial ranks,
    shared between layouts of one rank count (their memos: the layers' costs by shape)."""
    from hybridpar.search.layers import planner

    graph, ctx0 = s.lg.graph, s.ctx
    local = local_graph(graph, lay)  # a Linear head whole under channel/filter, unsummed under sample = 1
    lg = build_layer_graph(local)
    contexts = {} if contexts is None else contexts
    ctx = contexts.get(lay.spatial)
    if ctx is None:
        ctx = contexts[lay.spatial] = CostContext(
            ctx0.cluster, local.batch, ctx0.ranks, ctx0.dtype, ctx0.calibration, bn_stats=ctx0.bn_stats,
            optimizer=ctx0.optimizer, momentum=ctx0.momentum, weight_decay=ctx0.weight_decay)
        ctx.kept = frozenset(kept_activations(local))  # node names are the same under every split
        ctx.formats = None if ctx0.formats is None else channels_last_layout(local)  # halo windows too
    opts = planner._options(lg, ctx, INF, [proxy_layout(lay)], even_only=False, empty_ok=True)
    if lay.g_size > 1:
        opts = [_no_concat_rule(_whole_conv_gather(vo, local, lay, ctx), lay, ctx) for vo in opts]
    originals = graph.by_name
    inputs = {n.name for n in graph.nodes if n.op == "input"}
    halo_s = 0.0
    for i, vo in enumerate(opts):
        names = [vo.vertex.node.name, *(f.name for f in vo.vertex.followers)]
        if i == 0:  # the nodes before the first layer run on its ranks (CosmoFlow's first conv3d)
            names += [n.name for n in lg.prefix]
        opts[i], t = _with_halo(vo, names, originals, lay, ctx, inputs)
        opts[i] = _with_spatial_sums(opts[i], names, originals, lay, ctx)
        opts[i] = _with_spatial_gathers(opts[i], names, originals, lay, ctx)
        halo_s += t
    opts[-1] = _with_output_gather(opts[-1], lg, graph, lay, ctx)
    pred, brk = planner.predict_with_breakdown(lg, opts, [0] * len(opts), ctx, grad_sync)
    if lay.sample == 1:  # (a Linear head's gradients: not summed, local_graph's "grad_summed")
        pred, brk = _without_loss_allreduce(pred, brk, (lg, opts, ctx), grad_sync)
    sliding = tuple(n.module or n.name for n in graph.nodes if n.op in SLIDING and len(n.in_shapes[0]) > 2)
    return SpatialEval(lay, lg, ctx, opts, pred, brk, halo_s, sliding)


def _without_loss_allreduce(pred: Prediction, brk, priced: tuple, grad_sync: str):
    """`pred` and its breakdown without the loss allreduce the proxy's P "sample groups" priced
    (planner._step_extras): under sample = 1 they are one, and the run allreduces no loss
    (train.engine). Its time is taken out where the proxy paid it (not where it rode in a gradient
    bucket: planner._rides_in_bucket), and its bytes."""
    from hybridpar.search.layers import planner
    from hybridpar.search.layers.decomposition import shard_groups

    lg, opts, ctx = priced
    last = opts[-1].dist(0)
    if last.sample == 1:
        return pred, brk
    key = LayerLayout(sample=last.sample, channel=last.channel)
    op = CommOp.placed("allreduce", "loss", ctx.elem, shard_groups(key), "shard", key)
    buckets = planner.grad_bucket_schedule(lg, opts, [0] * len(opts), ctx) if grad_sync == "buckets" else []
    t = 0.0 if planner._rides_in_bucket(op, buckets) else ctx.comm_time(op)
    comm = dict(pred.comm_bytes)
    comm["allreduce"] = comm.get("allreduce", 0) - ctx.elem
    step = pred.step_time_s - t
    pred = pred.model_copy(update={"comm_bytes": {k: v for k, v in comm.items() if v}, "step_time_s": step,
                                   "comm_s": pred.comm_s - t, "exposed_comm_s": max(0.0, step - pred.compute_s)})
    return pred, dataclasses.replace(brk, extras_s=brk.extras_s - t)


def best_spatial(s, gpus: int, batch: int, grad_sync: str) -> tuple[SpatialEval | None, SpatialEval | None]:
    """(the fastest uniform spatial layout that fits the memory limit, the fastest of all), each None
    when there is none."""
    best = fitting = None
    contexts: dict[int, CostContext] = {}
    for lay in spatial_layouts(s.lg.graph, gpus, batch):
        if lay.to_strategy() in s.excluded:
            continue
        ev = evaluate_spatial(s, lay, grad_sync, contexts)
        if best is None or ev.pred.step_time_s < best.pred.step_time_s:
            best = ev
        fits = ev.pred.memory_bytes[0] <= s.capacity
        if fits and (fitting is None or ev.pred.step_time_s < fitting.pred.step_time_s):
            fitting = ev
    return fitting, best


def _ms(t: float) -> str:
    return f"{t * 1e3:.1f} ms"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _layers_note(ev: SpatialEval) -> str:
    mods = ev.sliding
    listed = ", ".join(mods[:4]) + (f", ... ({len(mods)} in all)" if len(mods) > 4 else "")
    return (f"spatial: {ev.layout.to_strategy()} for every layer; the {len(mods)} convolutions and poolings "
            f"({listed}) split each sample's {_split_text(ev.layout)} with halo exchanges "
            f"({_ms(ev.halo_s)} per step, not overlapped)")


def _split_text(lay: LayerLayout) -> str:
    return " x ".join(f"{k} in {getattr(lay, k)}" for k in SPATIAL_DIMS if getattr(lay, k) > 1)


def _summary(chosen: str | None, ev: SpatialEval | None, base: Prediction | None, label: str) -> dict:
    """The comparison as data (`plan --json`'s "spatial"): whether the plan goes spatial and why
    ("time", "memory"; or why not: "slower", "over the memory limit", "not considered"), the best
    spatial layout's predicted step, memory and halo time, and the best plan without spatial splits'."""
    return {
        "chosen": chosen in ("time", "memory"), "reason": chosen,
        "best_spatial": None if ev is None else {
            "layout": ev.layout.to_strategy(), "step_time_s": ev.pred.step_time_s,
            "memory_bytes_per_device": ev.pred.memory_bytes[0], "halo_s": ev.halo_s,
            "halo_bytes": ev.pred.comm_bytes.get("halo", 0)},
        "best_non_spatial": None if base is None else {"method": label.lstrip(", ") or None,
                                                        "step_time_s": base.step_time_s},
        "speedup": None if ev is None or base is None or not ev.pred.step_time_s
        else base.step_time_s / ev.pred.step_time_s,
    }


def compare(s, other: Prediction | InfeasibleError, gpus: int, batch: int, grad_sync: str, label: str = ""
            ) -> tuple[SpatialEval | None, list[str], dict | None]:
    """(the spatial layout to plan instead of `other`, or None; notes for the plan either way; the
    comparison as data, `_summary`). `other`: the best plan without spatial splits' prediction, or the
    InfeasibleError its search raised."""
    nd = model_ndim(s.lg.graph)
    if nd not in (1, 2, 3) or gpus == 1:  # no spatial dims (a sequence model), or nothing to split over
        return None, [], None
    fitting, best = best_spatial(s, gpus, batch, grad_sync)
    base = None if isinstance(other, InfeasibleError) else other
    if best is None:  # the runtime's reason for the plainest one, when it refuses
        why = layout_refusal(s.lg.graph, LayerLayout(**{SPATIAL_DIMS[3 - nd]: gpus}))
        return None, ["spatial splits not considered: " + (why or f"no uniform sample x spatial layout of {gpus} "
                                                                  f"ranks is left for this model at batch {batch} "
                                                                  "(the runtime or its dry run refused each)")], \
            _summary("not considered", None, base, label)
    if base is None:
        if fitting is None:
            return None, [], _summary("over the memory limit", best, None, label)
        return fitting, [_layers_note(fitting), f"spatial chosen for memory: {fitting.pred.step_time_s * 1e3:.1f} ms "
                         f"per step, {_gib(fitting.pred.memory_bytes[0])} per device; no plan without spatial "
                         f"splits fits ({other})"], _summary("memory", fitting, None, label)
    if fitting is not None and fitting.pred.step_time_s < base.step_time_s:
        return fitting, [_layers_note(fitting), (
            f"spatial chosen for time: {_ms(fitting.pred.step_time_s)} per step against {_ms(base.step_time_s)} "
            f"for the best plan without spatial splits{label} ({base.step_time_s / fitting.pred.step_time_s:.2f}x "
            f"speed-up); {_gib(fitting.pred.memory_bytes[0])} per device")], _summary("time", fitting, base, label)
    ev = fitting or best
    why = "slower" if fitting is not None else f"over the memory limit ({_gib(ev.pred.memory_bytes[0])} per device)"
    return None, [f"no layer goes spatial: the best uniform spatial layout, {ev.layout.to_strategy()}, predicts "
                  f"{_ms(ev.pred.step_time_s)} per step (halo exchanges {_ms(ev.halo_s)}) against "
                  f"{_ms(base.step_time_s)} for this plan: {why}"], \
        _summary("slower" if fitting is not None else "over the memory limit", ev, base, label)


def to_plan(s, ev: SpatialEval, strategy: str | None, notes: list[str]):
    """(Plan, rows) of a uniform spatial layout: planner._to_plan's, with the layout itself (not its
    sample-parallel proxy) and the global batch."""
    from hybridpar.search.layers import planner

    proxy_setup = dataclasses.replace(s, lg=ev.lg, ctx=ev.ctx)
    plan, rows = planner._to_plan(proxy_setup, ev.opts, ev.choice, ev.pred, strategy, notes)
    data = plan.model_dump()
    data.update(batch=s.ctx.batch, default_layout=ev.layout, layers={})
    plan = Plan(**data)
    rows = tuple(dataclasses.replace(r, choice=ev.layout.to_strategy(), layout=ev.layout if r.layout else None)
                 for r in rows)
    return plan, rows


def _gradients(s, ev: SpatialEval):
    from hybridpar.search.layers import planner

    return planner._gradients(dataclasses.replace(s, lg=ev.lg, ctx=ev.ctx), ev.opts, ev.choice)


def fixed_gradients(s, layout: LayerLayout, opts, choice):
    """planner._gradients of a fixed spatial `layout` (`fixed`'s options): listed on the rank's view
    of the graph (local_graph: a Linear head's gradient unsummed under sample = 1), as priced."""
    from hybridpar.search.layers import planner

    lg = build_layer_graph(local_graph(s.lg.graph, layout))
    return planner._gradients(dataclasses.replace(s, lg=lg), opts, choice)


def with_spatial(s, cfg, where: tuple[int, int, float], base: tuple, search: Callable[[], object]):
    """planner.plan_model's result: `search()`'s plan (without spatial splits), or the fastest uniform
    spatial layout that fits when it beats that plan or nothing else fits; the notes say which and why.
    `where`: (gpus, batch, start time); `base`: (DP baseline, its breakdown, its note, the FSDP
    baseline's (prediction, note, breakdown))."""
    import time

    from hybridpar.search.layers.planner import PlanResult

    gpus, batch, t0 = where
    baseline, base_brk, note, fsdp = base
    try:
        result, other = search(), None
    except InfeasibleError as err:
        result, other = _uniform_fallback(s, cfg, (gpus, batch, t0), base, err), err
    if cfg.free_sample:  # a projection-only space: the runtime's uniform spatial layouts are not its question
        if result is None:
            raise other
        return result
    ev, notes, summary = compare(s, other if result is None else result.prediction, gpus, batch, cfg.grad_sync,
                                 "" if result is None else f", {result.method}")
    if ev is None:
        if result is None:
            raise other
        return dataclasses.replace(result, plan=result.plan.model_copy(update={"notes": [*result.plan.notes, *notes]}),
                                   spatial=summary)
    method = f"uniform {ev.layout.to_strategy()}"
    plan, rows = to_plan(s, ev, None, [f"optimiser: {method} (spatial layouts run uniformly)", *notes])
    if result is not None:
        return dataclasses.replace(result, plan=plan, layers=rows, prediction=ev.pred, method=method, pruned={},
                                   solve_s=time.perf_counter() - t0, breakdown=ev.breakdown,
                                   gradients=_gradients(s, ev), spatial=summary)
    return PlanResult(plan, rows, ev.pred, baseline, note, method, {}, time.perf_counter() - t0, ev.breakdown,
                      base_brk, _gradients(s, ev), *fsdp, spatial=summary)


def _uniform_fallback(s, cfg, where: tuple[int, int, float], base: tuple, err: InfeasibleError):
    """When the search finds nothing (it prunes layouts that leave a layer's pieces empty, e.g. a
    2-channel segmentation head split 8 ways), the fastest uniform sample/channel/filter layout that
    fits and the runtime runs (empty pieces included, as `--strategy` evaluates it), as a PlanResult;
    None if none fits."""
    import time

    from hybridpar.search.layers import planner

    gpus, batch, t0 = where
    baseline, base_brk, note, fsdp = base
    best = None
    for layouts in planner.runtime_layouts(gpus, batch).values():
        for lay in layouts:
            if layout_refusal(s.lg.graph, lay) or lay.zero or lay.to_strategy() in s.excluded:
                continue
            try:
                opts, choice, pred, brk = planner._evaluate_uniform(s, lay, cfg.grad_sync)
            except InfeasibleError:
                continue
            if pred.memory_bytes[0] <= s.capacity and (best is None or pred.step_time_s < best[2].step_time_s):
                best = (opts, choice, pred, brk, lay)
    if best is None:
        return None
    opts, choice, pred, brk, lay = best
    method = f"uniform {lay.to_strategy()}"
    notes = [f"optimiser: {method}; the search found nothing ({err}), so the fastest uniform layout is taken "
             "(layers with fewer channels than pieces run with empty pieces)"]
    plan, rows = planner._to_plan(s, opts, choice, pred, None, notes)
    return planner.PlanResult(plan, rows, pred, baseline, note, method, {}, time.perf_counter() - t0, brk, base_brk,
                              planner._gradients(s, opts, choice), *fsdp)


def fixed(s, cfg, layout: LayerLayout, refusal: str | None):
    """planner._plan_fixed's (plan, rows, prediction, breakdown, options, choice) for a uniform spatial
    `layout` (`--strategy height=2`, `height=2,channel=2`): evaluated, not searched. A what-if
    (`runnable_only` False) of a dim the model lacks is refused: there is nothing to price it by."""
    try:
        spatial_dims(layout, model_ndim(s.lg.graph))
    except ValueError as err:
        raise UserError(f"{layout.to_strategy()}: {err}") from None
    cf_why = spatial_cf_refusal(s.lg.graph, layout)
    if cf_why is not None:  # even as a what-if: no figure of the planner's would be the run's
        raise UserError(cf_why)
    ev = evaluate_spatial(s, layout, cfg.grad_sync)
    notes = [f"fixed layout {layout.to_strategy()} evaluated (not searched)", _layers_note(ev)]
    if layout.g_size > 1:
        notes += _cf_unpriced_note(s.lg.graph, layout)
    notes += [f"WHAT-IF, the runtime cannot run it: {refusal}"] if refusal else []
    if ev.pred.memory_bytes[0] > s.capacity:
        notes.append(f"over the memory limit: {_gib(ev.pred.memory_bytes[0])} per device")
    plan, rows = to_plan(s, ev, layout.to_strategy(), notes)
    return plan, rows, ev.pred, ev.breakdown, ev.opts, ev.choice
