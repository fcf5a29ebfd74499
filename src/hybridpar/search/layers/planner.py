"""Per-layer decomposition planner (Dryden et al. SC19, planning half): choose sample/channel/filter
splits per layer to minimise the predicted step time under per-device memory.

Pipeline: graph -> layer graph (weight layers and joins) -> options per layer with their costs
(`layer_cost`) -> choice problem with redistribution costs on edges -> exact optimiser (DP on
series-parallel graphs, ILP otherwise or when memory binds) -> step-time prediction with the
gradient allreduce overlapping backward as the runtime does it -> `hybridpar.plans.Plan`.

The optimiser adds costs; overlap is not additive. So the optimiser runs with the gradient
allreduce weighted 1, ½ and 0, the uniform layouts are added as candidates, and the one whose
*simulated* step time is lowest wins — never worse than pure data parallelism when that fits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from hybridpar.cluster import Cluster, load_cluster
from hybridpar.cost.collectives import CommOp
from hybridpar.cost.compute import channels_last_layout
from hybridpar.cost.layout_comm import BUCKET_BYTES, layout_refusal, splits_by_layout
from hybridpar.cost.memory import JOIN_OPS, kept_activations
from hybridpar.errors import InfeasibleError, UserError
from hybridpar.graph.types import Graph
from hybridpar.plans import LayerLayout, Plan, Prediction, parse_strategy
from hybridpar.search import budget
from hybridpar.search.layers import fsdp_baseline
from hybridpar.search.layers.decomposition import (
    Distribution,
    Pruned,
    all_layouts,
    distribution_of,
    distributions,
    filter_groups,
    layout_of,
    layout_problem,
    shard_groups,
)
from hybridpar.search.layers.gradients import ParamGradient, grad_allreduce_bytes, gradient_listing, outside_nodes
from hybridpar.search.layers.layer_cost import (
    CostContext,
    LayerCost,
    channels_of,
    dist_memory,
    grad_allreduce,
    join_cost,
    node_signature,
    node_time,
    nodes_comm,
    nodes_time,
    redistribution_time,
    weight_layer_cost,
)
from hybridpar.search.layers.layer_graph import LayerGraph, Vertex, build_layer_graph
from hybridpar.search.layers.layout_ilp import solve
from hybridpar.search.layers.sp_dp import INF, ChoiceProblem
from hybridpar.search.options import with_options

GRAD_WEIGHTS = (1.0, 0.5, 0.0)


def _size(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class VertexOptions:
    vertex: Vertex
    options: tuple[LayerLayout | Distribution, ...]
    costs: tuple[LayerCost, ...]
    pruned: tuple[Pruned, ...]

    def dist(self, k: int) -> Distribution:
        return self.dists[k]

    @cached_property
    def dists(self) -> tuple[Distribution, ...]:
        """Each option's distribution (asked for per edge of every prediction)."""
        return tuple(o if isinstance(o, Distribution) else distribution_of(o) for o in self.options)


@dataclass(frozen=True)
class LayerChoice:
    name: str
    module: str | None
    op: str
    choice: str
    layout: LayerLayout | None
    cost: LayerCost
    whole: bool = False  # a layer the runtime runs whole under any layout (cost.layout_comm.splits_by_layout)

    @property
    def algorithm(self) -> str:
        if self.layout is None:
            return "join"
        return "whole" if self.whole else self.layout.algorithm


@dataclass(frozen=True)
class PlanResult:
    plan: Plan
    layers: tuple[LayerChoice, ...]
    prediction: Prediction
    baseline: Prediction | None  # pure data parallelism (None when it does not fit)
    baseline_note: str
    method: str
    pruned: dict[str, tuple[Pruned, ...]]
    solve_s: float
    breakdown: StepBreakdown | None = None
    baseline_breakdown: StepBreakdown | None = None
    # every parameterised module with its gradient bytes (sums to breakdown.grad_bytes)
    gradients: tuple[ParamGradient, ...] = ()
    # the second baseline, "FSDP + full recomputation" (search.layers.fsdp_baseline; None: see the note)
    fsdp_baseline: Prediction | None = None
    fsdp_note: str = ""
    fsdp_breakdown: object | None = None  # fsdp_baseline.FsdpBreakdown
    # the search's spatial comparison (search.layers.spatial_plan.compare: best spatial layout against the
    # best plan without spatial splits, chosen or not and why); None when it did not run
    spatial: dict | None = None

    @property
    def speedup_vs_dp(self) -> float | None:
        if self.baseline is None or self.prediction.step_time_s <= 0:
            return None
        return self.baseline.step_time_s / self.prediction.step_time_s

    @property
    def speedup_vs_fsdp(self) -> float | None:
        if self.fsdp_baseline is None or self.prediction.step_time_s <= 0:
            return None
        return self.fsdp_baseline.step_time_s / self.prediction.step_time_s


# -- graph -------------------------------------------------------------------------------------

@lru_cache(maxsize=16)
def _traced_spec(model: str, input_shape: tuple[int, ...] | None):
    """Graph traced once per model at batch 1 (costs scale the batch; tracing is the slow part)."""
    from hybridpar.search.graph_cache import traced_graph

    return traced_graph(model, input_shape)


def _traced(model, input_shape: tuple[int, ...] | None) -> tuple[Graph, tuple[int, ...] | None, str]:
    """(graph, per-sample input shape, name) of a zoo name / file spec, a Graph, or (module, inputs)."""
    if isinstance(model, str):
        graph, shape = _traced_spec(model, input_shape)
        return graph, shape, model
    if isinstance(model, Graph):
        return model, input_shape, model.name
    if isinstance(model, tuple) and len(model) == 2:
        from hybridpar.graph import trace

        module, inputs = model
        graph = trace(module, inputs)
        first = inputs[0] if isinstance(inputs, (tuple, list)) and inputs else inputs
        shape = tuple(first.shape[1:]) if getattr(first, "dim", lambda: 0)() > 1 else input_shape
        return graph, shape, graph.name
    raise UserError("model must be a zoo name, 'file.py:factory', a Graph or (module, example_inputs)")


def _scaled(graph, batch: int):
    """Node FLOPs and shapes for the global batch (hybridpar.cost.scaling: time-major shapes too)."""
    from hybridpar.cost.scaling import graph_at_batch

    return graph_at_batch(graph, batch)


# -- options -----------------------------------------------------------------------------------

def _weight_options(v: Vertex, ctx: CostContext, layouts: Sequence[LayerLayout], capacity: float,
                    even_only: bool, empty_ok: bool = False, input_from: tuple[int, ...] | None = (),
                    whole_in: bool = False, joined: bool = False) -> VertexOptions:
    node = v.node
    cin, cout = channels_of(node.in_shapes[0]), channels_of(node.out_shape)
    # a layer the runtime leaves whole (a grouped/depthwise conv, attention's projections: cost.
    # layout_comm.splits_by_layout) runs under any layout, replicated over channel/filter
    whole = not splits_by_layout(node)
    opts, costs, pruned = [], [], []
    sig = (node_signature(node), tuple(node_signature(f) for f in v.followers), v.input_grad, _kept_flags(v, ctx),
           whole_in if splits_by_layout(node) else (input_from, joined))
    for lay in layouts:
        reason = layout_problem(lay, ctx.batch, cin, cout, even=even_only, empty_ok=empty_ok or whole)
        if reason is None:
            key = (sig, lay)
            cost = ctx.layer_memo.get(key)
            if cost is None:
                cost = ctx.layer_memo[key] = weight_layer_cost(node, v.followers, lay, ctx, input_grad=v.input_grad,
                                                               input_from=input_from, whole_in=whole_in,
                                                               joined=joined)
            if cost.memory_bytes > capacity:
                reason = f"needs {_size(cost.memory_bytes)} per device for this layer alone"
            else:
                opts.append(lay)
                costs.append(cost)
                continue
        pruned.append(Pruned(lay, reason))
    return VertexOptions(v, tuple(opts), tuple(costs), tuple(pruned))


def _kept_flags(v: Vertex, ctx: CostContext) -> tuple[bool, ...] | None:
    """Which of a layer's nodes autograd keeps (two layers of equal shapes can differ: a batch norm
    that feeds a ReLU is freed, one that feeds an add's ReLU too, one that feeds a conv is kept)."""
    return None if ctx.kept is None else tuple(n.name in ctx.kept for n in (v.node, *v.followers))


def _join_options(v: Vertex, ctx: CostContext, dists: Sequence[Distribution], whole: bool = False,
                  split_inputs: bool = True) -> VertexOptions:
    sig = ("join", node_signature(v.node), tuple(node_signature(f) for f in v.followers), _kept_flags(v, ctx), whole,
           split_inputs, v.input_grad)
    costs = []
    for d in dists:
        cost = ctx.layer_memo.get((sig, d))
        if cost is None:
            cost = ctx.layer_memo[(sig, d)] = join_cost(v.node, v.followers, d, ctx, whole, split_inputs,
                                                        v.input_grad)
        costs.append(cost)
    return VertexOptions(v, tuple(dists), tuple(costs), ())


def _split_size(v: Vertex) -> int | None:
    """The size of the dim a weight layer's output is split on (a linear's features, a conv's
    channels): runtime.dtensors.settle gathers it whole where a piece is empty. None for a join."""
    if not v.is_weight:
        return None
    return v.node.out_shape[-1] if v.node.op == "linear" else channels_of(v.node.out_shape)


def _inputs_from(lg: LayerGraph) -> dict[int, tuple[int, ...] | None]:
    """Per weight vertex, the split size (`_split_size`) of the layer whose split output is its input
    (its node's first input: a later one can be a shape the tracer saw read, as HF PVTv2's
    depthwise conv's height and width), or None when it arrives whole (the model's input or the
    prefix's, a tensor `_whole_tensors` holds whole)."""
    owner = {n.name: i for i, v in enumerate(lg.vertices) for n in (v.node, *v.followers)}
    whole = _whole_tensors(lg)
    out: dict[int, tuple[int, ...] | None] = {}
    for i, v in enumerate(lg.vertices):
        j = owner.get(v.node.inputs[0]) if v.node.inputs else None
        k = None if j is None else _split_size(lg.vertices[j])
        out[i] = None if j is None or v.node.inputs[0] in whole else ((k,) if k is not None else ())
    return out


def _whole_inputs(lg: LayerGraph) -> set[int]:
    """Weight vertices whose input is a tensor another vertex holds whole (`_whole_tensors`; not the
    model's input or the prefix's) and needs a gradient: a split layer's slice of it has its gradient
    gathered (cost.layout_comm.whole_grad_gather)."""
    owner = {n.name: i for i, v in enumerate(lg.vertices) for n in (v.node, *v.followers)}
    whole = _whole_tensors(lg)
    return {i for i, v in enumerate(lg.vertices)
            if v.is_weight and v.input_grad and v.node.inputs and v.node.inputs[0] in owner
            and v.node.inputs[0] in whole}


def _sources(lg: LayerGraph) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for e in lg.edges:
        out.setdefault(e.dst, []).append(e.src)
    return out


def _whole_origins(lg: LayerGraph) -> dict[str, frozenset[int]]:
    """The nodes whose output the runtime holds whole on channel_filter (DTensor: Replicate), each
    with the whole convs it comes from: a layer the runtime leaves whole (cost.layout_comm.
    splits_by_layout); a join or follower whose inputs (those the layers make) are all whole, but a
    batch norm (it takes its channel piece); or a layer, group or RMS norm (approximation: DTensor
    gathers the channels it normalises over, as for HF ConvNeXt's channels-first LayerNorm or a
    transformer's LayerNorm over split features; no conv origin). Per node, from its own inputs: a
    later layer may read a follower before the norm, or one on another branch (CLIP's pooled
    post-LayerNorm beside the mean its classifier reads)."""
    owned = {n.name for v in lg.vertices for n in (v.node, *v.followers)}
    out: dict[str, frozenset[int]] = {}

    def from_inputs(n) -> frozenset[int] | None:
        # an elementwise join's operands, else the data input: the tracer also lists tensors whose
        # shape the forward read (a reshape to a patch embedding's height and width)
        ins = [i for i in (n.inputs if n.op in JOIN_OPS else n.inputs[:1]) if i in owned]
        if not ins or any(i not in out for i in ins):
            return None
        return frozenset().union(*(out[i] for i in ins))

    for i, v in enumerate(lg.vertices):  # in graph order: a node's inputs come before it
        if v.is_weight:
            origin = None if splits_by_layout(v.node) else frozenset({i} if v.node.op == "conv2d" else ())
        else:
            origin = from_inputs(v.node)
        if origin is not None:
            out[v.node.name] = origin
        for f in v.followers:
            if f.op == "batchnorm":
                continue
            origin = frozenset() if f.op == "layernorm" and f.attr("stat_numel") else from_inputs(f)
            if origin is not None:
                out[f.name] = origin
    return out


def _whole_tensors(lg: LayerGraph) -> set[str]:
    """Names of the nodes whose output the runtime holds whole on channel_filter (`_whole_origins`)."""
    return set(_whole_origins(lg))


def _whole_outputs(lg: LayerGraph) -> set[int]:
    """Vertices whose output (`Vertex.out_node`) the runtime holds whole (`_whole_tensors`)."""
    tensors = _whole_tensors(lg)
    return {i for i, v in enumerate(lg.vertices) if v.out_node.name in tensors}


def _joined_convs(lg: LayerGraph) -> set[int]:
    """Whole conv vertices whose output, or a whole tensor made from it, meets a split operand in an
    elementwise join (not a concatenation): DTensor slices the whole operand inside the join, its
    gradient stays split back to the conv (through elementwise ops, pooling, a mean), and the conv's
    backward gathers it at its output (cost.layout_comm.whole_grad_gather; measured: one gather per
    conv however many joins)."""
    origins = _whole_origins(lg)
    owner = {n.name: i for i, v in enumerate(lg.vertices) for n in (v.node, *v.followers)}
    out: set[int] = set()
    for v in lg.vertices:
        if v.is_weight or v.node.op == "concat" or not v.input_grad:
            continue
        ins = [name for name in v.node.inputs if name in owner]
        whole = [name for name in ins if name in origins]
        if whole and len(whole) < len(ins):
            out.update(*(origins[name] for name in whole))
    return out


def _options(lg: LayerGraph, ctx: CostContext, capacity: float, layouts: Sequence[LayerLayout],
             even_only: bool, empty_ok: bool = False, inputs_from: dict | None = None,
             whole_inputs: set[int] | None = None, joined: set[int] | None = None) -> list[VertexOptions]:
    """Options of every vertex; joins take the distributions the weight layers' layouts produce.
    `inputs_from`: `_inputs_from` of the graph `lg` is part of (default: of `lg`)."""
    dists = sorted({distribution_of(lay) for lay in layouts})
    whole, sources = _whole_outputs(lg), _sources(lg)
    inputs_from = _inputs_from(lg) if inputs_from is None else inputs_from
    whole_inputs = _whole_inputs(lg) if whole_inputs is None else whole_inputs
    joined = _joined_convs(lg) if joined is None else joined
    out = []
    for i, v in enumerate(lg.vertices):
        if v.is_weight:
            vo = _weight_options(v, ctx, layouts, capacity, even_only, empty_ok, inputs_from[i], i in whole_inputs,
                                 i in joined)
            if not vo.options:
                why = "; ".join(f"{p.layout.to_strategy()}: {p.reason}" for p in vo.pruned[:3])
                raise InfeasibleError(f"layer {v.node.module or v.name} has no feasible decomposition ({why})")
        else:
            ch = channels_of(v.node.out_shape)
            ok = [d for d in dists if d in distributions(ctx.ranks, ctx.batch, ch)] if even_only else dists
            vo = _join_options(v, ctx, ok or dists, i in whole, not any(j in whole for j in sources.get(i, ())))
        out.append(vo)
    return out


def runtime_layouts(ranks: int, batch: int) -> dict[int, list[LayerLayout]]:
    """The runtime's space: one sample degree S for the whole model (its S x G process grid), each
    layer choosing channel x filter = G = ranks / S. Keyed by S."""
    out: dict[int, list[LayerLayout]] = {}
    for lay in all_layouts(ranks):
        if batch % lay.sample == 0:
            out.setdefault(lay.sample, []).append(lay)
    return out


# -- problem and prediction --------------------------------------------------------------------

def _prefix_time(lg: LayerGraph, dist: Distribution, ctx: CostContext) -> tuple[float, float]:
    """Forward and backward seconds of the nodes before the first layer (an embedding, recurrent
    layers over it), on the first vertex's distribution (`layer_cost.node_time`), scaled as the
    layers are where the model's step was measured (search.layers.measured)."""
    if not lg.prefix:
        return 0.0, 0.0
    fwd, bwd = nodes_time(lg.prefix, dist, ctx)
    ofwd, obwd = ctx.runtime_overhead(len(lg.prefix), dist.channel)
    k = ctx.measured_factor(dist.channel, exact=False)
    return (fwd + ofwd) * k, (bwd + obwd) * k


def _prefix_memory(lg: LayerGraph, dist: Distribution, ctx: CostContext):
    """Memory of the nodes before the first layer on the first vertex's distribution (`dist_memory`)."""
    key = ("prefix", tuple(n.name for n in lg.prefix), dist)
    hit = ctx.layer_memo.get(key)
    if hit is None:
        hit = ctx.layer_memo[key] = dist_memory(lg.prefix, dist, ctx)
    return hit


def _problem(lg: LayerGraph, opts: list[VertexOptions], ctx: CostContext, grad_weight: float,
             edge_cost: tuple[np.ndarray, ...] | None = None) -> ChoiceProblem:
    node_cost = tuple(np.array([c.fwd_s + c.bwd_s + c.comm_fwd_s + c.comm_bwd_s + grad_weight * c.grad_sync_s
                                for c in vo.costs]) for vo in opts)
    node_mem = tuple(np.array([c.memory_bytes for c in vo.costs]) for vo in opts)
    if lg.prefix and opts:  # the nodes before the first layer run on the first vertex's distribution
        first = range(len(opts[0].options))
        node_cost = (node_cost[0] + np.array([sum(_prefix_time(lg, opts[0].dist(k), ctx)) for k in first]),
                     *node_cost[1:])
        node_mem = (node_mem[0] + np.array([_prefix_memory(lg, opts[0].dist(k), ctx).persistent_bytes
                                            for k in first]), *node_mem[1:])
    if edge_cost is None:
        edge_cost = _edge_costs(lg, opts, ctx)
    names = tuple(vo.vertex.name for vo in opts)
    return ChoiceProblem(names, node_cost, node_mem, tuple((e.src, e.dst) for e in lg.edges), edge_cost)


def _edge_costs(lg: LayerGraph, opts: list[VertexOptions], ctx: CostContext) -> tuple[np.ndarray, ...]:
    """Redistribution time of every edge for every pair of its ends' options: computed once per pair
    of distinct distributions (options of one distribution share rows and columns)."""
    classes = []  # per vertex: its distinct distributions and each option's index among them
    for vo in opts:
        found: dict[Distribution, int] = {}
        idx = np.array([found.setdefault(vo.dist(k), len(found)) for k in range(len(vo.options))], dtype=np.int64)
        classes.append((list(found), idx))
    out = []
    for e in lg.edges:
        (du, iu), (dv, iv) = classes[e.src], classes[e.dst]
        numel = e.per_sample_numel * ctx.batch
        small = np.array([[redistribution_time(numel, a, b, ctx) for b in dv] for a in du], dtype=float)
        out.append(small[np.ix_(iu, iv)])
    return tuple(out)


def _step_extras(opts: list[VertexOptions], choice: Sequence[int], ctx: CostContext,
                 whole_out: bool = False) -> list[CommOp]:
    """Per-step collectives outside the layers, as `hybridpar train` issues them: each sample group's
    outputs gathered over its channel pieces (when G > 1), the loss (each group's mean) allreduced
    over the sample groups for reporting (hybridpar.train.engine), and the finiteness check's flags
    where ranks hold different gradients (phase "check": priced, not counted in the step's bytes)."""
    last = opts[-1].dist(choice[-1])
    out_node = opts[-1].vertex.out_node
    grid = LayerLayout(sample=last.sample, channel=1, filter=last.channel)
    ops = []
    if last.channel > 1 and not whole_out:  # an output held whole (_output_whole) is not gathered
        per_sample = out_node.out_numel // max(out_node.out_shape[0], 1) if out_node.out_shape else 1
        gathered = ctx.batch // last.sample * per_sample * ctx.elem
        ops.append(CommOp.placed("allgather", "fwd", gathered, filter_groups(grid), "filter", grid))
    if last.sample > 1:
        key = LayerLayout(sample=last.sample, channel=last.channel)
        ops.append(CommOp.placed("allreduce", "loss", ctx.elem, shard_groups(key), "shard", key))
    sample_only = all(vo.dist(k).channel == 1 and vo.dist(k).sample == ctx.ranks for vo, k in zip(opts, choice))
    if ctx.ranks > 1 and not sample_only:
        # the train loop's finiteness check: where ranks hold different gradients, one small allreduce
        # of its own each step (hybridpar.train.guard.StateGuard.check_step); not step traffic
        world = LayerLayout(sample=ctx.ranks)
        ops.append(CommOp.placed("allreduce", "check", 2 * 8, shard_groups(world), "world", world))
    return ops


_WHOLE_OUT: dict[int, tuple[LayerGraph, bool]] = {}


def _output_whole(lg: LayerGraph) -> bool:
    """Whether the model's output (the last vertex's) is a tensor the runtime holds whole on
    channel_filter (`_whole_tensors`: a whole conv, then a mean): runtime.dtensors.gather_output then
    moves nothing. Memoised per layer graph (asked once per predicted choice)."""
    hit = _WHOLE_OUT.get(id(lg))
    if hit is None or hit[0] is not lg:  # the graph kept alive in the value: its id is not reused
        if len(_WHOLE_OUT) > 64:
            _WHOLE_OUT.clear()
        hit = _WHOLE_OUT[id(lg)] = (lg, bool(lg.vertices) and lg.vertices[-1].out_node.name in _whole_tensors(lg))
    return hit[1]


def _rides_in_bucket(op: CommOp, buckets) -> bool:
    """The loss allreduce goes inside a gradient bucket over the same ranks launched during backward
    (hybridpar.parallel.comm.grad_sync.GradSync.carry): its bytes are sent, its latency is not paid."""
    return op.phase == "loss" and any(
        i is not None and shard_groups(key) == op.groups for key, _, i in buckets)


@dataclass(frozen=True)
class StepBreakdown:
    """Where a predicted step's communication goes (seconds)."""

    grad_sync_s: float  # weight-gradient allreduce (segmented)
    layer_comm_s: float  # channel/filter allgathers and reduce-scatters, batch-norm statistics
    redistribution_s: float
    extras_s: float  # output gather and loss allreduce
    grad_bytes: int = 0  # the weight-gradient allreduce's bytes on one rank (every trainable parameter)


def grad_bucket_schedule(lg: LayerGraph, opts: list[VertexOptions], choice: Sequence[int], ctx: CostContext,
                         bucket_bytes: int = BUCKET_BYTES) -> list[tuple[LayerLayout, int, int | None]]:
    """The runtime's gradient buckets for this choice (hybridpar.parallel.comm.grad_sync.GradSync, rule
    in hybridpar.cost.layout_comm.bucket_schedule): (shard-group key, bytes, i) per launch in launch
    order, i = the backward-order index of the vertex whose backward readies the bucket (len(opts):
    the end of backward; None: replicated DTensor parameters, which GradSync sums after backward).
    Gradients are ready at the end of their vertex's backward (approximation: the runtime readies
    each where its node's backward runs), within it in the runtime's order: followers from the last,
    then the layer, a bias before its weight."""
    from hybridpar.cost.layout_comm import bucket_schedule, grad_ready_bytes
    from hybridpar.search.layers.gradients import SPLIT_OPS, grad_allreduce_bytes, outside_nodes

    ready: list[tuple[LayerLayout, int]] = []
    vertex_of: list[int] = []
    late: list[tuple[LayerLayout, int, None]] = []

    def grads(n, lay: LayerLayout) -> tuple[LayerLayout, tuple[int, ...], int]:
        """(shard-group key, bytes ready in backward order, bytes summed after backward) of node n."""
        g = lay.channel * lay.filter
        key = layout_of(lay.sample, g)
        if g > 1 and (n.op not in SPLIT_OPS or (n.op != "batchnorm" and not splits_by_layout(n))):
            # a replicated DTensor parameter (a linear the runtime leaves whole too)
            return key, (), grad_allreduce_bytes(n, key, ctx.elem, ctx.bn_stats)
        # a linear's input features split as DTensor chunks them (layout_comm's default pieces)
        return key, tuple(grad_ready_bytes(n, lay, dtype_bytes=ctx.elem)), 0

    memo, sigs = ctx.grad_ready_memo, ctx.grad_ready_sigs

    def place(n, lay: LayerLayout, i: int) -> None:
        # memoised by what decides the bytes (identical layers share them) and the layout: the search
        # predicts many choices that share most layers' layouts
        sig = sigs.get(id(n))
        if sig is None or sig[0] is not n:  # the node kept alive in the value: its id is not reused
            params = tuple((name.rsplit(".", 1)[-1], tuple(shape)) for name, shape in n.param_shapes)
            sig = sigs[id(n)] = (n, (n.op, n.in_shapes, n.out_shape, params))
        k = (sig[1], lay)
        hit = memo.get(k)
        if hit is None:
            hit = memo[k] = grads(n, lay)
        key, now, after = hit
        if after:
            late.append((key, after, None))
        for b in now:
            ready.append((key, b))
            vertex_of.append(i)

    for i, (vo, k) in enumerate(zip(reversed(opts), reversed(choice))):
        o = vo.options[k]
        lay = o if isinstance(o, LayerLayout) else layout_of(o.sample, o.channel)
        for n in (*reversed(vo.vertex.followers), vo.vertex.node):
            if n.param_shapes:
                place(n, lay, i)
    d = opts[0].dist(choice[0])
    for _, n in (x for x in outside_nodes(lg) if x[0] < 0):  # before the first layer: backward's last
        place(n, layout_of(d.sample, d.channel), len(opts))
    out = [(key, b, vertex_of[i] if i < len(ready) else len(opts))
           for key, b, i in bucket_schedule(ready, bucket_bytes)]
    # GradSync sums the replicated DTensor gradients together, one allreduce per set of mesh dims
    # they are Partial on; priced as all Partial on (sample, channel_filter): one allreduce over all
    # S x G ranks (approximation: DTensor leaves some Partial on `sample` only, e.g. attention's
    # in_proj weight, a second collective over the S ranks, same bytes)
    whole: dict[LayerLayout, int] = {}
    for key, b, _ in late:
        world = layout_of(key.sample * key.channel * key.filter)
        whole[world] = whole.get(world, 0) + b
    return out + [(key, b, None) for key, b in whole.items()]


def step_extra_s(lg: LayerGraph, held, sample: int, ctx: CostContext) -> float:
    """Seconds per step outside the layers' ops (hybridpar.cost.update): the optimizer's step and
    zero_grad over every parameter tensor (each rank holds a piece of each) of the local elements
    `held` (LayerMemory) says, and the loss over this rank's outputs (its sample group's, whole)."""
    tensors = sum(len(n.param_shapes) for n in lg.graph.nodes)
    elements = sum(m.weights_bytes for m in held) / ctx.elem
    out_numel = sum(lg.graph.node(o).out_numel for o in lg.graph.outputs)  # the graph is at the global batch
    return ctx.work.update_s(tensors, elements) + ctx.work.loss_s(out_numel / sample)


def predict(lg: LayerGraph, opts: list[VertexOptions], choice: Sequence[int], ctx: CostContext,
            grad_sync: str = "flat") -> Prediction:
    return predict_with_breakdown(lg, opts, choice, ctx, grad_sync)[0]


_OUTSIDE_BYTES: dict[tuple, tuple[object, int]] = {}


def _outside_grad_bytes(lg: LayerGraph, opts: list[VertexOptions], choice: Sequence[int],
                        ctx: CostContext) -> dict[LayerLayout, int]:
    """Gradient allreduce bytes of the parameters no weight vertex's LayerCost holds (followers of
    joins, nodes before the first layer: embeddings, norms, attention, recurrent layers, free
    parameters), by the shard groups they go to (search.layers.gradients: the listing's rule)."""
    out: dict[LayerLayout, int] = {}
    for i, n in outside_nodes(lg):
        d = opts[max(i, 0)].dist(choice[max(i, 0)])
        k = (id(n), d, ctx.elem, ctx.bn_stats)
        hit = _OUTSIDE_BYTES.get(k)
        if hit is None or hit[0] is not n:
            if len(_OUTSIDE_BYTES) > 65536:
                _OUTSIDE_BYTES.clear()
            hit = _OUTSIDE_BYTES[k] = (n, grad_allreduce_bytes(n, layout_of(d.sample, d.channel), ctx.elem,
                                                                ctx.bn_stats))
        if hit[1]:
            key = layout_of(d.sample, d.channel)
            out[key] = out.get(key, 0) + hit[1]
    return out


def _grad_sync_time(grad_sync: str, costs, buckets, by_key: dict, backward: tuple, ctx: CostContext
                    ) -> tuple[float, float]:
    """(gradient allreduce seconds, step seconds) after backward. `backward`: (when each vertex's
    backward ends in backward order, backward's end, when the communication stream is free)."""
    done, t, comm_free = backward
    if grad_sync == "overlap":
        return sum(c.grad_sync_s for c in costs), max(t, comm_free)
    if grad_sync != "buckets":
        grad = sum(ctx.comm_time(grad_allreduce(b, key)) for key, b in by_key.items())
        return grad, t + grad
    grad, step = 0.0, t  # as hybridpar.parallel.comm.grad_sync runs it
    for key, b, i in buckets:
        dt = ctx.comm_time(grad_allreduce(b, key))
        grad += dt
        if i is None:  # replicated DTensor parameters: summed after backward, blocking
            step += dt
        else:  # launched when its last gradient is ready, after the buckets before it
            comm_free = max(comm_free, done[i] if i < len(done) else t) + dt
    return grad, max(step, comm_free + step - t)


def _per_layer(lg: LayerGraph, opts: list[VertexOptions], costs, redist: list[float], d0, ctx: CostContext) -> dict:
    """Each layer's (and each prefix node's) times and memory, keyed by module name."""
    per_layer = {}
    k = ctx.measured_factor(d0.channel, exact=False)  # as _prefix_time scales them
    for n in lg.prefix:  # before the first layer (an embedding, recurrent layers), on the first vertex's ranks
        nt = node_time(n, d0, ctx)
        nbytes_held = dist_memory([n], d0, ctx).persistent_bytes
        if nt.fwd_s or nt.bwd_s or nbytes_held:
            per_layer[n.module or n.name] = {"fwd_s": nt.fwd_s * k, "bwd_s": nt.bwd_s * k, "comm_s": 0.0,
                                             "grad_sync_s": 0.0, "memory_bytes": nbytes_held}
    for vo, c, r in zip(opts, costs, redist):
        key = vo.vertex.node.module or vo.vertex.name
        per_layer[key] = {"fwd_s": c.fwd_s, "bwd_s": c.bwd_s, "comm_s": c.comm_fwd_s + c.comm_bwd_s + r,
                          "grad_sync_s": c.grad_sync_s, "memory_bytes": c.memory_bytes}
    return per_layer


def predict_with_breakdown(lg: LayerGraph, opts: list[VertexOptions], choice: Sequence[int], ctx: CostContext,
                           grad_sync: str = "flat") -> tuple[Prediction, StepBreakdown]:
    """Step time: forward in order, backward in reverse, then the weight-gradient allreduce.

    grad_sync="buckets": as hybridpar.parallel does it (`grad_bucket_schedule`): 4 MiB buckets per
    shard group in backward order, each allreduce queued on one communication stream when its bucket
    fills, overlapping the rest of backward. "flat": one allreduce of all local gradients per shard
    group after backward (no overlap). "overlap": each layer's allreduce is queued on one
    communication stream as soon as its backward is done (LBANN/Horovod style)."""
    costs = [vo.costs[k] for vo, k in zip(opts, choice)]
    redist = [0.0] * len(opts)  # per destination vertex, forward + backward
    for e in lg.edges:
        redist[e.dst] += redistribution_time(e.per_sample_numel * ctx.batch, opts[e.src].dist(choice[e.src]),
                                             opts[e.dst].dist(choice[e.dst]), ctx)
    extras = _step_extras(opts, choice, ctx, _output_whole(lg))
    buckets = grad_bucket_schedule(lg, opts, choice, ctx) if grad_sync == "buckets" else []
    extra_s = sum(ctx.comm_time(op) for op in extras if not _rides_in_bucket(op, buckets))
    pre_fwd, pre_bwd = _prefix_time(lg, opts[0].dist(choice[0]), ctx)
    # the prefix's own collectives (a batch norm on the input: its statistics; no input gradient there)
    pre_cf, pre_cb, pre_bytes = nodes_comm(lg.prefix, opts[0].dist(choice[0]), ctx, input_grad=False) \
        if lg.prefix else (0.0, 0.0, {})
    t = pre_fwd + pre_cf + sum(c.fwd_s + c.comm_fwd_s for c in costs) + sum(r / 2 for r in redist) + extra_s
    comm_free = 0.0
    done = []  # when each vertex's backward ends, in backward order
    for c, r in zip(reversed(costs), reversed(redist)):
        t += c.bwd_s + c.comm_bwd_s + r / 2
        done.append(t)
        if grad_sync == "overlap" and c.grad_sync_s:
            comm_free = max(comm_free, t) + c.grad_sync_s
    t += pre_bwd + pre_cb  # backward's last: the nodes before the first layer (their gradients ready after)
    by_key: dict[LayerLayout, int] = {}
    for c in costs:
        if c.grad_bytes and c.grad_key is not None:
            by_key[c.grad_key] = by_key.get(c.grad_key, 0) + c.grad_bytes
    for key, b in _outside_grad_bytes(lg, opts, choice, ctx).items():
        by_key[key] = by_key.get(key, 0) + b
    grad, step = _grad_sync_time(grad_sync, costs, buckets, by_key, (done, t, comm_free), ctx)
    if grad_sync != "flat" and ctx.cluster.device.comm_takes_compute:
        step = t + grad  # the exchanges run on the cores backward runs on: nothing hides (DeviceSpec)
    d0 = opts[0].dist(choice[0])
    held = [c.memory for c in costs] + ([_prefix_memory(lg, d0, ctx)] if lg.prefix else [])
    # the loss on this rank's outputs before backward, the optimizer on its shards after the last sync
    extra_compute = step_extra_s(lg, held, opts[-1].dist(choice[-1]).sample, ctx)
    step += extra_compute
    compute = pre_fwd + pre_bwd + sum(c.fwd_s + c.bwd_s for c in costs) + extra_compute
    comm = sum(c.comm_fwd_s + c.comm_bwd_s for c in costs) + sum(redist) + grad + extra_s + pre_cf + pre_cb
    nbytes: dict[str, int] = dict(pre_bytes)
    for op in [*(op for op in extras if op.phase != "check"), *(grad_allreduce(b, k) for k, b in by_key.items())]:
        nbytes[op.kind] = nbytes.get(op.kind, 0) + op.bytes_
    for c in costs:
        for k, b in c.comm_bytes.items():
            nbytes[k] = nbytes.get(k, 0) + b
    from hybridpar.cost.memory import io_bytes, redistribution_transient_bytes, step_memory

    redist_tmp = max((redistribution_transient_bytes(e.per_sample_numel * ctx.batch, ctx.ranks, ctx.elem)
                      for e in lg.edges if opts[e.src].dist(choice[e.src]) != opts[e.dst].dist(choice[e.dst])),
                     default=0.0)
    # every layer's memory and the prefix's; the step adds the largest transient (a layer's, a
    # redistribution's, the optimizer step's), the input/output and the framework
    rank_mem = step_memory(held, framework_bytes=ctx.framework_bytes, io_bytes=io_bytes(lg.graph, ctx.batch, ctx.elem),
                           optimizer=ctx.optimizer, weight_decay=ctx.weight_decay, extra_transient_bytes=redist_tmp)
    mem = int(rank_mem.total_bytes)
    per_layer = _per_layer(lg, opts, costs, redist, d0, ctx)
    pred = Prediction(step_time_s=step, compute_s=compute, comm_s=comm, exposed_comm_s=max(0.0, step - compute),
                      memory_bytes=[mem] * ctx.ranks, comm_bytes=nbytes, per_layer=per_layer)
    layer_comm = sum(c.comm_fwd_s + c.comm_bwd_s for c in costs)
    return pred, StepBreakdown(grad, layer_comm, sum(redist), extra_s, sum(by_key.values()))


# -- public API --------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Setup:
    lg: LayerGraph
    ctx: CostContext
    capacity: float
    input_shape: tuple[int, ...] | None
    cluster_name: str
    model_name: str
    excluded: tuple[str, ...] = ()  # PlannerConfig.exclude_layouts: strategies never chosen


@dataclass(frozen=True)
class PlannerConfig:
    """Everything `plan_model` takes besides the model, the cluster, the device count and the batch.

    `memory_limit`: bytes per device (None: the device's memory). `strategy`: evaluate this uniform
    layout instead of searching. `grad_sync`: buckets | flat | overlap. `free_sample`: every layer may
    choose its own sample degree (a projection-only space). `time_share`: the measured slowdown of each
    rank's compute with all ranks running (None: the cluster's). `optimizer`/`momentum`/`weight_decay`:
    the training run's, in `hybridpar train`'s words. `runnable_only`: only layouts the runtime can run
    (False prices any layout, a what-if). `calibration`: a Calibration to price with (None: this
    machine's file)."""

    memory_limit: float | None = None
    strategy: str | None = None
    dtype: str = "fp32"
    input_shape: tuple[int, ...] | None = None
    grad_sync: str = "buckets"
    free_sample: bool = False
    calibration: object | None = None
    time_share: float | None = None
    optimizer: str = "sgd"
    momentum: float = 0.0
    weight_decay: float = 0.0
    runnable_only: bool = True
    # strategies the search never chooses (hybridpar.api.plan: layouts its dry run refused for this model)
    exclude_layouts: tuple[str, ...] = ()
    recompute: str = "auto"  # auto: the planner chooses (with zero=2|3) when memory binds; none | all fix it
    # 4-D weights and activations in NHWC memory, as `train --channels-last` runs them: priced from
    # channels-last op records where this machine has them (cost.compute.channels_last_layout, op_time)
    channels_last: bool = False

    @classmethod
    def of(cls, config: PlannerConfig | None = None, options: dict | None = None) -> PlannerConfig:
        """`config` (default: the defaults) with `options` (keyword arguments of plan_model) over it."""
        return with_options(cls, config, options)


def _setup(model, cluster: str | Cluster, gpus: int, batch: int, cfg: PlannerConfig) -> _Setup:
    memory_limit, dtype, input_shape, time_share = cfg.memory_limit, cfg.dtype, cfg.input_shape, cfg.time_share
    if gpus < 1:
        raise UserError(f"gpus must be >= 1, got {gpus}", param="gpus")
    if batch < 1:
        raise UserError(f"batch must be >= 1, got {batch}", param="batch")
    if not (cfg.momentum >= 0 and cfg.weight_decay >= 0):  # NaN too
        raise UserError(f"momentum and `weight_decay` must be >= 0, got {cfg.momentum} and {cfg.weight_decay}",
                        param="momentum")
    # the least the plan does: one collective over all ranks (before enumerating layouts of `gpus`)
    budget.check(f"plan on {gpus:,} GPUs", budget.collective_estimate(gpus), "plan fewer GPUs")
    cl = cluster if isinstance(cluster, Cluster) else load_cluster(cluster, gpus=gpus)
    if time_share is not None:  # measured slowdown of each rank's compute when all ranks run at once
        if not math.isfinite(time_share) or time_share <= 0:
            raise UserError(f"time_share must be positive, got {time_share}", param="time_share")
        cl = cl.model_copy(update={"device": cl.device.model_copy(update={"time_share": float(time_share)})})
    if cl.num_devices < gpus:
        raise UserError(f"gpus {gpus}: cluster {cl.name!r} has only {cl.num_devices} devices", param="gpus")
    graph, shape, name = _traced(model, tuple(input_shape) if input_shape else None)
    lg = build_layer_graph(_scaled(graph, batch))
    if not any(v.is_weight for v in lg.vertices):
        raise UserError(f"model {name!r} has no conv2d or linear layer to decompose")
    capacity = float(memory_limit) if memory_limit is not None else float(cl.device.memory_bytes)
    ctx = CostContext(cl, batch, gpus, dtype, cfg.calibration, optimizer=cfg.optimizer, momentum=cfg.momentum,
                      weight_decay=cfg.weight_decay)
    ctx.kept = frozenset(kept_activations(lg.graph))
    ctx.formats = channels_last_layout(lg.graph) if cfg.channels_last else None
    s = _Setup(lg, ctx, capacity, shape, cl.name, name, tuple(cfg.exclude_layouts))
    from hybridpar.search.layers.measured import apply_measured

    apply_measured(s, model, cfg.calibration, input_shape)  # the model's steps `hybridpar profile` timed
    return s


def _to_plan(s: _Setup, opts: list[VertexOptions], choice: Sequence[int], pred: Prediction,
             strategy: str | None, notes: list[str]) -> tuple[Plan, tuple[LayerChoice, ...]]:
    layers: dict[str, LayerLayout] = {}
    wholes: dict[str, LayerLayout] = {}  # run whole in the default layout: the runtime takes no layout for them
    rows = []
    for vo, k in zip(opts, choice):
        o = vo.options[k]
        lay = o if isinstance(o, LayerLayout) else None
        whole = lay is not None and not splits_by_layout(vo.vertex.node)
        if lay is not None and vo.vertex.node.module:
            (wholes if whole else layers)[vo.vertex.node.module] = lay
        text = lay.to_strategy() if lay else f"sample={o.sample},channel={o.channel}"
        rows.append(LayerChoice(vo.vertex.name, vo.vertex.node.module, vo.vertex.node.op, text, lay, vo.costs[k],
                                whole))
    counts: dict[LayerLayout, int] = {}
    for lay in (layers or wholes).values():
        counts[lay] = counts.get(lay, 0) + 1
    default = max(counts, key=counts.get) if counts else LayerLayout(sample=s.ctx.ranks)
    used = {(lay.channel, lay.filter) for lay in (default, *layers.values(), *wholes.values()) if lay.spatial == 1}
    if any(s.ctx.measured_factor(c, f) != 1.0 for c, f in used):  # priced from the model's measured steps
        notes = [*notes, *s.ctx.measured_notes]
    plan = Plan(model=s.model_name, input_shape=list(s.input_shape) if s.input_shape else None, cluster=s.cluster_name,
                world_size=s.ctx.ranks, batch=s.ctx.batch, dp=s.ctx.ranks, mp=1, default_layout=default,
                layers=layers, strategy=strategy, predicted=pred, notes=notes)
    return plan, tuple(rows)


def _evaluate_uniform(s: _Setup, lay: LayerLayout, grad_sync: str):
    opts = _options(s.lg, s.ctx, INF, [lay], even_only=False, empty_ok=True)
    choice = [0] * len(opts)
    pred, brk = predict_with_breakdown(s.lg, opts, choice, s.ctx, grad_sync)
    return opts, choice, pred, brk


def _search_space(s: _Setup, layouts: Sequence[LayerLayout], even_only: bool, grad_sync: str):
    """Best (choice, prediction, method, options) over one option space, or None if nothing fits."""
    opts = _options(s.lg, s.ctx, s.capacity, layouts, even_only)
    edges = _edge_costs(s.lg, opts, s.ctx)
    best = None
    predicted: dict[tuple[int, ...], tuple[Prediction, StepBreakdown]] = {}

    def predict_once(choice: Sequence[int]) -> tuple[Prediction, StepBreakdown]:
        # the grad weights' solutions and the uniform layouts often coincide (ResNet-50 at 1,024
        # GPUs: 21 distinct choices of 35): each choice is simulated once
        key = tuple(int(k) for k in choice)
        if key not in predicted:
            predicted[key] = predict_with_breakdown(s.lg, opts, key, s.ctx, grad_sync)
        return predicted[key]

    for w in GRAD_WEIGHTS:
        try:
            sol = solve(_problem(s.lg, opts, s.ctx, w, edges), s.capacity - s.ctx.framework_bytes)
        except ValueError:
            continue
        pred, brk = predict_once(sol.choice)
        if pred.memory_bytes[0] <= s.capacity and (best is None or pred.step_time_s < best[1].step_time_s):
            best = (list(sol.choice), pred, sol.method, opts, brk)
    for lay in layouts:  # uniform layouts as candidates (overlap is not additive)
        idx = []
        for vo in opts:
            want = lay if vo.vertex.is_weight else distribution_of(lay)
            if want not in vo.options:
                break
            idx.append(vo.options.index(want))
        else:
            pred, brk = predict_once(idx)
            if pred.memory_bytes[0] <= s.capacity and (best is None or pred.step_time_s < best[1].step_time_s):
                best = (idx, pred, f"uniform {lay.to_strategy()}", opts, brk)
    return best


def plan_model(model, cluster: str | Cluster = "localhost", gpus: int = 1, batch: int = 32,
               config: PlannerConfig | None = None, *, progress: Callable[[str], None] | None = None,
               **options) -> PlanResult:
    """Plan `model` on `gpus` devices of `cluster` at global batch `batch` (or evaluate a strategy) with
    `config` (a PlannerConfig; keyword `options` are its fields, over it).

    By default the space is the runtime's: one sample degree S for the model, each layer choosing
    channel x filter = gpus / S (no redistribution between layers). `free_sample` lets every layer
    choose its own sample degree too, paying an all-to-all redistribution where neighbours differ
    (Dryden et al.'s full space; such a plan runs only if its sample degrees agree).
    `time_share` overrides how much slower each rank computes when all ranks run at once (the cluster
    assumes ranks/cores on localhost; a machine shared with other jobs is slower: measure it).
    `optimizer`/`momentum`/`weight_decay`: the training run's (as `hybridpar train` takes them; default
    its plain SGD), for the optimizer state in the per-device memory (hybridpar.cost.memory).
    `runnable_only`: plan and evaluate only layouts hybridpar's runtime can run, else a UserError with
    the reason (cost.layout_comm.layout_refusal); False prices any layout (a what-if; the CLI's
    --no-dry-run). `progress(message)` is told each search space as it starts."""
    import time

    t0 = time.perf_counter()
    cfg = PlannerConfig.of(config, options)
    fsdp_baseline.check_recompute(cfg.recompute)
    s = _setup(model, cluster, gpus, batch, cfg)
    spaces = _runnable_spaces(s, cfg, gpus, batch)
    baseline, base_brk, note = _data_parallel(s, cfg, gpus, batch)
    fsdp = fsdp_baseline.baseline(s, cfg.grad_sync, gpus, batch)
    if cfg.strategy is not None:
        plan, rows, pred, brk, opts, choice = _plan_fixed(s, cfg, gpus, batch)
        if plan.default_layout.spatial > 1:  # listed on the rank's view, as priced (spatial_plan)
            from hybridpar.search.layers.spatial_plan import fixed_gradients

            grads = fixed_gradients(s, plan.default_layout, opts, choice)
        else:
            grads = _gradients(s, opts, choice)
        return PlanResult(plan, rows, pred, baseline, note, "fixed", {}, time.perf_counter() - t0, brk, base_brk,
                          grads, *fsdp)
    if cfg.recompute == "all":  # every candidate recomputes: sample-only layouts (where recomputation runs)
        return _searched(s, cfg, spaces, (baseline, base_brk, note, fsdp, t0), progress)
    from hybridpar.search.layers import spatial_plan  # uniform spatial layouts beside the search (issue 30)

    return spatial_plan.with_spatial(s, cfg, (gpus, batch, t0), (baseline, base_brk, note, fsdp),
                                     lambda: _searched(s, cfg, spaces, (baseline, base_brk, note, fsdp, t0), progress))


def _searched(s: _Setup, cfg: PlannerConfig, spaces: dict[str, list[LayerLayout]], base: tuple,
              progress: Callable[[str], None] | None) -> PlanResult:
    """plan_model's search over the sample/channel/filter spaces (and sharding when memory binds)."""
    import time

    baseline, base_brk, note, fsdp, t0 = base
    if cfg.recompute == "all" or baseline is None:  # memory binds (or recomputation is asked for)
        if progress:
            progress("pricing sharded / recomputing layouts")
        return fsdp_baseline.plan_with_sharding(s, cfg, spaces, (baseline, base_brk, note, fsdp, t0), progress)
    choice, pred, method, opts, brk = _best_of_spaces(s, cfg, spaces, progress)
    notes = [f"optimiser: {method}"] + ([note] if note else [])
    notes += sorted({f"WHAT-IF, the runtime cannot run it: {r}" for r in (
        layout_refusal(s.lg.graph, lay) for lay in _chosen_layouts(opts, choice)) if r})
    if cfg.free_sample and len({lay.sample for lay in _chosen_layouts(opts, choice)}) > 1:
        notes.append("layers use different sample degrees: the runtime needs one (plan for projection only)")
    plan, rows = _to_plan(s, opts, choice, pred, None, notes)
    pruned = {vo.vertex.node.module or vo.vertex.name: vo.pruned for vo in opts if vo.pruned}
    return PlanResult(plan, rows, pred, baseline, note, method, pruned, time.perf_counter() - t0, brk, base_brk,
                      _gradients(s, opts, choice), *fsdp)


def _runnable_spaces(s: _Setup, cfg: PlannerConfig, gpus: int, batch: int) -> dict[str, list[LayerLayout]]:
    """The layout spaces to search, less the layouts the runtime cannot run (cost.layout_comm.layout_refusal:
    the --strategy check's rule too); UserError with the first refusal when none is left."""
    if cfg.strategy is not None:
        spaces = {"fixed": [LayerLayout(sample=gpus)]}
    elif cfg.free_sample:
        spaces = {"free": [lay for lay in all_layouts(gpus) if batch % lay.sample == 0]}
    else:
        spaces = {f"S={k}": v for k, v in runtime_layouts(gpus, batch).items()}
    spaces = {k: [lay for lay in v if lay.to_strategy() not in s.excluded] for k, v in spaces.items()}
    refusals = {k: [cfg.runnable_only and layout_refusal(s.lg.graph, lay) for lay in v] for k, v in spaces.items()}
    runnable = {k: [lay for lay, r in zip(v, refusals[k]) if not r] for k, v in spaces.items()}
    first = next((r for rs in refusals.values() for r in rs if r), None)
    if first and not any(runnable.values()):
        raise UserError(first)
    spaces = {k: v for k, v in runnable.items() if v}
    budget.check(f"plan of {s.model_name} on {gpus:,} GPUs at batch {batch:,}",
                 budget.layer_plan_estimate(len(s.lg.vertices), gpus, spaces),
                 "plan fewer GPUs (and project larger counts with hybridpar project)")
    return spaces


def _data_parallel(s: _Setup, cfg: PlannerConfig, gpus: int, batch: int):
    """(prediction, breakdown, note) of data parallelism over `gpus`: the baseline, or (None, None, why)."""
    if batch % gpus:
        return None, None, f"data parallelism needs the batch ({batch}) divisible by {gpus}"
    try:
        _, _, baseline, base_brk = _evaluate_uniform(s, LayerLayout(sample=gpus), cfg.grad_sync)
    except InfeasibleError as err:
        return None, None, f"data parallelism infeasible: {err}"
    if baseline.memory_bytes and baseline.memory_bytes[0] > s.capacity:
        return None, None, (f"data parallelism needs {_size(baseline.memory_bytes[0])} per device, "
                            f"over the {_size(s.capacity)} limit")
    return baseline, base_brk, ""


def _plan_fixed(s: _Setup, cfg: PlannerConfig, gpus: int, batch: int):
    """(plan, rows, prediction, breakdown, options, choice) of the uniform layout `cfg.strategy`."""
    strat = parse_strategy(cfg.strategy, gpus)
    if strat.mp != 1:
        raise UserError("strategy: the per-layer planner evaluates channel/filter/sample layouts; "
                        "mp>1 is for the placer (`hybridpar place`)", param="strategy")
    reason = layout_problem(strat.layout, batch, 1 << 30, 1 << 30)
    if reason:
        raise UserError(f"strategy {cfg.strategy!r}: {reason}")
    refusal = layout_refusal(s.lg.graph, strat.layout)
    if refusal and cfg.runnable_only:
        raise UserError(refusal)
    if strat.layout.spatial > 1:  # priced on one rank's view of the graph (search.layers.spatial_plan)
        from hybridpar.search.layers import spatial_plan

        return spatial_plan.fixed(s, cfg, strat.layout, refusal)
    if strat.layout.zero or cfg.recompute == "all":  # priced on the sharded simulator (fsdp_baseline)
        return fsdp_baseline.fixed(s, cfg, strat.layout, refusal)
    opts, choice, pred, brk = _evaluate_uniform(s, strat.layout, cfg.grad_sync)
    notes = [f"fixed layout {strat.layout.to_strategy()} evaluated (not searched)"]
    notes += [f"WHAT-IF, the runtime cannot run it: {refusal}"] if refusal else []
    if pred.memory_bytes[0] > s.capacity:
        notes.append(f"over the memory limit: {_size(pred.memory_bytes[0])} per device")
    plan, rows = _to_plan(s, opts, choice, pred, strat.layout.to_strategy(), notes)
    return plan, rows, pred, brk, opts, choice


def _best_of_spaces(s: _Setup, cfg: PlannerConfig, spaces: dict[str, list[LayerLayout]],
                    progress: Callable[[str], None] | None):
    """(choice, prediction, method, options, breakdown): the fastest plan over every space that fits;
    InfeasibleError naming why when none does."""
    best, reasons = None, []
    for key, layouts in spaces.items():
        if progress:
            progress(f"optimising {key}")
        try:
            found = _search_space(s, layouts, even_only=cfg.free_sample, grad_sync=cfg.grad_sync)
        except InfeasibleError as err:
            reasons.append(f"{key}: {err}")
            continue
        if found is None:
            reasons.append(f"{key}: over the memory limit")
        elif best is None or found[1].step_time_s < best[1].step_time_s:
            best = (found[0], found[1], found[2] if cfg.free_sample else f"{key}, {found[2]}", found[3], found[4])
    if best is None:
        raise InfeasibleError(f"no decomposition of {s.model_name} fits {_size(s.capacity)} per device "
                              f"on {s.ctx.ranks} devices at batch {s.ctx.batch} ({'; '.join(reasons[:3])})")
    return best


def _gradients(s: _Setup, opts: list[VertexOptions], choice: Sequence[int]) -> tuple[ParamGradient, ...]:
    return gradient_listing(s.lg, [vo.options[k] for vo, k in zip(opts, choice)], s.ctx.elem, s.ctx.bn_stats)


def _chosen_layouts(opts: list[VertexOptions], choice: Sequence[int]) -> list[LayerLayout]:
    return [vo.options[k] for vo, k in zip(opts, choice) if isinstance(vo.options[k], LayerLayout)]


def evaluate_plan(plan: Plan, *, grad_sync: str = "buckets", time_share: float | None = None,
                  calibration=None) -> Prediction:
    """Predict an existing plan's step (its own per-layer layouts), e.g. to compare with a measurement."""
    if plan.mp != 1:
        raise UserError("evaluate_plan: channel/filter/sample plans only (mp = 1)")
    shape = tuple(plan.input_shape) if plan.input_shape else None
    s = _setup(plan.model, plan.cluster, plan.world_size, plan.batch,
               PlannerConfig(input_shape=shape, calibration=calibration, time_share=time_share))
    if any(lay.spatial > 1 for lay in (plan.default_layout, *plan.layers.values())):  # uniform only
        from hybridpar.search.layers import spatial_plan

        if any(lay != plan.default_layout for lay in plan.layers.values()):
            raise UserError("evaluate_plan: spatial layouts run uniformly (no per-layer layouts)")
        return spatial_plan.evaluate_spatial(s, plan.default_layout, grad_sync).pred
    opts = []
    whole, sources, inputs_from = _whole_outputs(s.lg), _sources(s.lg), _inputs_from(s.lg)
    whole_in, joined = _whole_inputs(s.lg), _joined_convs(s.lg)
    for i, v in enumerate(s.lg.vertices):
        if v.is_weight:
            lay = plan.layout_of(v.node.module) if v.node.module else plan.default_layout
            opts.extend(_options(LayerGraph((v,), (), s.lg.graph), s.ctx, INF, [lay], even_only=False,
                                 empty_ok=True, inputs_from={0: inputs_from[i]},
                                 whole_inputs={0} if i in whole_in else set(), joined={0} if i in joined else set()))
        else:
            opts.append(_join_options(v, s.ctx, [distribution_of(plan.default_layout)], i in whole,
                                      not any(j in whole for j in sources.get(i, ()))))
    return predict(s.lg, opts, [0] * len(opts), s.ctx, grad_sync)


def planned_grad_buckets(model, strategy: str, *, gpus: int, batch: int, cluster: str | Cluster = "localhost",
                         input_shape: Sequence[int] | None = None,
                         bucket_bytes: int = BUCKET_BYTES) -> list[tuple[int, int, int]]:
    """(sample groups, ranks per sample group, bytes) of each gradient bucket the prediction of
    uniform `strategy` prices, in launch order (`grad_bucket_schedule`), to set beside what
    hybridpar.parallel.comm.grad_sync.GradSync launches (GradSync.buckets)."""
    s = _setup(model, cluster, gpus, batch, PlannerConfig(input_shape=tuple(input_shape) if input_shape else None))
    if parse_strategy(strategy, gpus).layout.spatial > 1:
        raise UserError(f"planned_grad_buckets: {strategy}: spatial layouts' buckets are not listed here")
    opts, choice, _, _ = _evaluate_uniform(s, parse_strategy(strategy, gpus).layout, "buckets")
    return [(k.sample, k.channel * k.filter, b) for k, b, _ in grad_bucket_schedule(s.lg, opts, choice, s.ctx,
                                                                                 bucket_bytes)]
