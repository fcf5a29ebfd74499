"""Time, communication and memory of one layer under one decomposition (Dryden et al. SC19, §IV).

A *layer* is a weight layer (conv2d or linear) or a join (add, concat), together with the nodes that
follow it up to the next layer (batch norm, ReLU, pooling, flatten...) which run on its output's
distribution. Its cost under a layout is:

- local compute of the local shapes (forward, backward-data, backward-weight) from
  `hybridpar.cost.compute.op_time` with the sample/channel/filter fractions;
- the algorithm's collectives on the real groups of the topology (`layout_collectives`): stationary-x
  reduce-scatters the partial outputs in the channel group (forward) and allgathers dy there (backward);
  stationary-y allgathers x in the filter group (forward) and reduce-scatters dx there (backward);
  batch norm allreduces its statistics across the sample group (global-batch statistics);
- the weight-gradient allreduce among the ranks holding the same shard: all c·f groups at once
  (`concurrent_allreduce_time`, the segmented allreduce, links shared);
- memory per device: hybridpar.cost.memory's per-layer terms (weights, gradients and optimizer state
  of the local shard, activations kept for backward with the gathered input under stationary-y,
  gradient buckets under sample > 1, and the layer's largest transient buffer); the nodes before the
  first layer (`dist_memory`) on the first vertex's distribution, as `node_time` prices them.

All groups of a collective (every channel group of a layer, every weight-shard group) run at once
and share links (`concurrent_collective_time`, `concurrent_allreduce_time`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from math import ceil, prod

from hybridpar.cost.collectives import CommOp
from hybridpar.cost.compute import ChannelsLast, variant_name
from hybridpar.cost.memory import (
    DEFAULT_OPTIMIZER,
    WHOLE_OPS,
    LayerMemory,
    nodes_memory,
    weight_layer_memory,
    with_cpu_unfold,
)
from hybridpar.graph.types import DTYPE_BYTES, Node
from hybridpar.layout import piece_sizes
from hybridpar.plans import LayerLayout
from hybridpar.search.layers.decomposition import (
    Distribution,
    Groups,
    channel_groups,
    filter_groups,
    layout_of,
    shard_groups,
)


@dataclass(frozen=True)
class LayerCost:
    fwd_s: float
    bwd_s: float
    comm_fwd_s: float
    comm_bwd_s: float
    grad_sync_s: float  # this layer's weight-gradient allreduce alone (the optimiser's additive cost)
    memory_bytes: float
    comm_bytes: dict[str, int] = field(default_factory=dict)
    grad_bytes: int = 0  # local gradient bytes (weights and its batch norms) to allreduce
    grad_key: LayerLayout | None = None  # (sample, channel=c·f): names the shard groups they go to
    transient_bytes: float = 0.0  # the layer's largest transient buffer (not summed over layers)
    memory: LayerMemory | None = None  # memory_bytes and transient_bytes by what holds them (cost.memory)
    # DTensor's own moves priced here, (kind, group size, bytes) as the dry run records them: whole
    # tensors' gradient gathers (cost.layout_comm.whole_grad_gather), so `hybridpar plan` does not add
    # the dry run's record of them again
    dtensor_moves: tuple[tuple[str, int, int], ...] = ()

    @property
    def total_s(self) -> float:
        """Everything serialised (the optimiser's conservative additive cost)."""
        return self.fwd_s + self.bwd_s + self.comm_fwd_s + self.comm_bwd_s + self.grad_sync_s


class CostContext:
    """The cluster, dtype and global batch the costs are for, with memoised collective times."""

    def __init__(self, cluster, batch: int, ranks: int, dtype: str = "fp32", calibration=None,
                 bn_stats: str = "global", optimizer: str = DEFAULT_OPTIMIZER, momentum: float = 0.0,
                 weight_decay: float = 0.0):
        from hybridpar.cost import collectives
        from hybridpar.cost.memory import framework_bytes_for, optimizer_state_copies

        optimizer_state_copies(optimizer, momentum)  # validates the name
        self.optimizer, self.momentum, self.weight_decay = optimizer, momentum, weight_decay
        self.framework_bytes = framework_bytes_for(cluster.device, calibration)

        self.cluster = cluster
        self.batch = batch
        self.ranks = ranks
        self.dtype = dtype
        self.calibration = calibration
        self.bn_stats = bn_stats
        # a channels-last run's NHWC nodes and conversion copies (cost.compute.channels_last_layout; the
        # planner sets it for `channels_last`), None: NCHW
        self.formats: ChannelsLast | None = None
        self.elem = DTYPE_BYTES[dtype]
        self._coll = collectives
        self._memo: dict[tuple, float] = {}
        self._fns: dict[tuple, object] = {}
        self._ops: dict[tuple, tuple] = {}
        # layer costs by what decides them (shapes, FLOPs, attributes, layout), not by node name:
        # ResNet-50's 16 bottleneck blocks have 10 distinct shapes between them
        self.layer_memo: dict[tuple, LayerCost] = {}
        # the graph's outputs autograd keeps for backward (cost.memory.kept_activations); the planner
        # sets it, and its layer-cost memo keys say which of a layer's nodes are kept
        self.kept: frozenset[str] | None = None
        # a node's gradient bytes in backward's ready order per layout (planner.grad_bucket_schedule)
        self.grad_ready_memo: dict[tuple, tuple] = {}
        self.grad_ready_sigs: dict[int, tuple] = {}
        # (channel, filter) -> factor on layer times measured for this model (search.layers.measured)
        self.measured: dict[tuple[int, int], float] = {}
        self.measured_notes: list[str] = []
        from hybridpar.cost.compute import runtime_overhead_for

        # what the runtime's own Python adds per node and per split layer (measured on localhost only)
        self.overhead = runtime_overhead_for(cluster.device, calibration) if ranks > 1 else None
        from hybridpar.cost.update import optimizer_kind, step_work

        # the optimizer step and the loss (not graph ops)
        self.work = step_work(cluster.device, optimizer_kind(optimizer, momentum), dtype=dtype,
                              calibration=calibration)

    def measured_factor(self, channel: int, filter_: int = 1, exact: bool = True) -> float:
        """The factor on a layer's forward and backward under a sample or channel/filter layout that
        `hybridpar profile --model` timed this model's step under (search.layers.measured): the layout's
        own (`exact`), else the mean of those with the same channel x filter, else 1. A join's
        activations are split the same way under channel=g and filter=g: it takes the mean. (Spatial
        layouts are priced in contexts of their own, which hold no factors: spatial_plan.)"""
        if not self.measured:
            return 1.0
        own = self.measured.get((channel, filter_)) if exact else None
        if own is not None:
            return own
        same = [k for (c, f), k in self.measured.items() if c * f == channel * filter_]
        return sum(same) / len(same) if same else 1.0

    def runtime_overhead(self, nodes: int, g: int, split_layers: int = 0) -> tuple[float, float]:
        """Forward and backward seconds the channel/filter/sample runtime adds to `nodes` graph nodes
        under a layout of g = channel x filter (g > 1: activations are DTensors), `split_layers` of them
        conv/linear layers split over channel/filter (hybridpar.profile.runtime_overhead)."""
        o = self.overhead
        if o is None:
            return 0.0, 0.0
        share = self.cluster.device.time_share
        nf, nb = (o.dtensor_node_fwd_s, o.dtensor_node_bwd_s) if g > 1 else (o.sample_node_fwd_s, o.sample_node_bwd_s)
        return ((nodes * nf + split_layers * o.layer_fwd_s) * share,
                (nodes * nb + split_layers * o.layer_bwd_s) * share)

    def spatial_op_overhead(self) -> tuple[float, float]:
        """Forward and backward seconds the spatial runtime adds to one convolution or pooling that
        exchanges a halo (hybridpar.profile.runtime_overhead's spatial_op)."""
        o = self.overhead
        if o is None:
            return 0.0, 0.0
        share = self.cluster.device.time_share
        return o.spatial_op_fwd_s * share, o.spatial_op_bwd_s * share

    def _time(self, kind: str, bytes_: int, key, groups) -> float:
        k = (kind, bytes_, key)
        if k not in self._memo:
            self._memo[k] = self._time_uncached(kind, bytes_, key, groups)
        return self._memo[k]

    def op(self, node: Node, s: int, channel_frac: float, filter_frac: float = 1.0, variant: str | None = None,
           as_model: bool = True):
        """op_time of `node` at a layout's local shape; `variant`: how the runtime runs it there when
        that differs from the plain op; `as_model`: on the model's own tensors, not under a
        channel/filter layout (hybridpar.cost.compute.op_time)."""
        from hybridpar.cost.compute import format_copy_time, op_time

        # memo per node object (kept alive in the value): the followers of a layer cost the same
        # under every (channel, filter) split with one product
        k = (id(node), s, channel_frac, filter_frac, variant, as_model)
        hit = self._ops.get(k)
        if hit is not None and hit[0] is node:
            return hit[1]
        # batch norm over several sample groups runs the runtime's global-statistics function
        if node.op == "batchnorm" and s > 1 and self.bn_stats == "global":
            variant = "batchnorm_global"
        cl = self.formats
        t = op_time(node, self.cluster.device, dtype=self.dtype, sample_frac=1.0 / s,
                    channel_frac=channel_frac, filter_frac=filter_frac, calibration=self.calibration,
                    variant=variant, memory_format="channels_last" if cl and node.name in cl.image else "nchw",
                    as_model=as_model)
        if cl and node.name in cl.copies:  # a channels-last activation read in NCHW order here: copied
            c = format_copy_time(node, cl.copies[node.name], self.cluster.device, self.dtype, 1.0 / s,
                                 channel_frac, filter_frac)
            t = dataclasses.replace(t, fwd_s=t.fwd_s + c.fwd_s, bwd_data_s=t.bwd_data_s + c.bwd_data_s)
        self._ops[k] = (node, t)
        return t

    def comm_time(self, op: CommOp) -> float:
        key = (op.group, op.layout) if op.group else op.groups
        return self._time(op.kind, op.bytes_, key, op.groups)

    def _time_uncached(self, kind: str, bytes_: int, key, groups: tuple[tuple[int, ...], ...]) -> float:
        if bytes_ <= 0 or len(groups[0]) <= 1:
            return 0.0
        cl, co = self.cluster, self._coll
        if kind == "allreduce":
            return self._segmented_allreduce(bytes_, key, groups)
        if kind == "alltoall":
            return co.alltoall_time(bytes_, groups[0], cl)
        return self._fn(kind, key, groups)(bytes_)

    def _fn(self, kind: str, key, groups, algo: str = "auto", first: bool = False):
        """The collective's time as a function of the bytes for one group set (its checks, ring
        orders and phases computed once; `collective_time_fn`), memoised by the set's cache key.
        `first`: the first group alone."""
        k = (kind, key, algo, first)
        fn = self._fns.get(k)
        if fn is None:
            fn = self._fns[k] = self._coll.collective_time_fn(kind, (groups[0],) if first else groups, self.cluster,
                                                              algo=algo)
        return fn

    def _segmented_allreduce(self, bytes_: int, key, groups) -> float:
        """Concurrent allreduces. The cost model offers the tree algorithm for one group only, yet
        small (latency-bound) allreduces in many groups at once run as trees too (NCCL picks per
        communicator); so the best single-group time, stretched by the link contention the ring
        algorithm sees among these groups, is taken when it beats the concurrent ring/hierarchical.
        (Approximation: contention of concurrent trees = that of concurrent rings.)"""
        shared = self._fn("allreduce", key, groups)(bytes_)
        if len(groups) == 1:
            return shared
        ring_many = self._fn("allreduce", key, groups, "ring")(bytes_)
        ring_one = self._fn("allreduce", key, groups, "ring", first=True)(bytes_)
        alone = self._fn("allreduce", key, groups, first=True)(bytes_)
        return min(shared, alone * max(1.0, ring_many / ring_one if ring_one > 0 else 1.0))


def node_signature(node: Node) -> tuple:
    """Everything a node's cost depends on: all but its name, module, input names and scope, with
    parameters named by their last component only (the cost model asks whether one is a weight or a
    bias)."""
    attrs = tuple((k, v) for k, v in node.attrs if k != "scope")
    try:
        hash(attrs)
    except TypeError:  # an unhashable attribute value (a list): its text stands for it
        attrs = repr(attrs)
    params = tuple((name.rsplit(".", 1)[-1], tuple(shape)) for name, shape in node.param_shapes)
    return (node.op, node.in_shapes, node.out_shape, params, node.fwd_flops, node.bwd_data_flops,
            node.bwd_weight_flops, attrs)


def _per_sample(shape: Sequence[int]) -> int:
    return prod(shape[1:]) if len(shape) > 1 else 1


def piece_frac(n: int, p: int) -> float:
    """Fraction of n channels in the largest of p pieces (uneven pieces differ by one)."""
    return ceil(n / p) / n if n > 0 else 1.0


def local_numel(shape: Sequence[int], batch: int, dist: Distribution) -> int:
    """Elements of a boundary tensor on the rank with the largest piece."""
    if len(shape) < 2:
        return batch // dist.sample
    spatial = prod(shape[2:]) if len(shape) > 2 else 1
    return batch // dist.sample * ceil(shape[1] / dist.channel) * spatial


def channels_of(shape: Sequence[int]) -> int:
    return int(shape[1]) if len(shape) > 1 else 1


@lru_cache(maxsize=4096)
def _groups_of(name: str, layout: LayerLayout) -> tuple[Groups, LayerLayout]:
    """The concurrent rank groups a layout_comm group name stands for, and their cache key."""
    s, g = layout.sample, layout.channel * layout.filter
    if name == "filter":
        return filter_groups(layout), layout
    if name == "channel":
        return channel_groups(layout), layout
    if name == "sample":  # the G ranks of one sample group
        key = layout_of(s, 1, g)
        return filter_groups(key), key
    key = layout_of(s, g)  # "replica": the S ranks holding the same shard
    return shard_groups(key), key


def layout_collectives(node: Node, followers: Sequence[Node], layout: LayerLayout, ctx: CostContext, *,
                       input_grad: bool = True, in_pieces: list[int] | None = None) -> list[CommOp]:
    """The collectives a weight layer and its followers (batch norms) issue per step under `layout` on
    the rank with the largest pieces, exactly as the runtime issues them
    (`hybridpar.cost.layout_comm`, the runtime's analytic twin), placed on this layout's rank groups."""
    from hybridpar.cost.layout_comm import layer_collectives

    ops: list[CommOp] = []
    for n in (node, *followers):
        for op in layer_collectives(n, layout, position=0, input_grad=input_grad or n is not node,
                                    in_pieces=in_pieces if n is node else None, bn_stats=ctx.bn_stats,
                                    dtype_bytes=ctx.elem):
            groups, key = _groups_of(op.group, layout)
            phase = "fwd" if op.phase == "loss" else op.phase
            ops.append(CommOp.placed(op.kind, phase, op.bytes_, groups, op.group, key))
    return ops


def node_time(n: Node, dist: Distribution, ctx: CostContext):
    """Compute of a node that runs on a vertex's distribution (a follower, or a node before the first
    layer on the first vertex's): its piece of the channels, but a recurrent layer whole on each rank
    for the rank's samples. The rule is the MP placer's: hybridpar.cost.compute.op_time at the
    rank's shape, the record `hybridpar profile` measured there first (an LSTM's), else the roofline."""
    frac = 1.0 if n.op in WHOLE_OPS else piece_frac(channels_of(n.out_shape), dist.channel)
    return ctx.op(n, dist.sample, frac, as_model=dist.channel == 1)


def nodes_time(nodes: Sequence[Node], dist: Distribution, ctx: CostContext) -> tuple[float, float]:
    """Forward and backward seconds of `nodes` (`node_time` each)."""
    fwd = bwd = 0.0
    for n in nodes:
        t = node_time(n, dist, ctx)
        fwd += t.fwd_s
        bwd += t.bwd_s
    return fwd, bwd



def _summarise(ops: Sequence[CommOp], ctx: CostContext) -> tuple[float, float, float, dict[str, int]]:
    t = {"fwd": 0.0, "bwd": 0.0, "grad": 0.0}
    nbytes: dict[str, int] = {}
    for op in ops:
        if op.phase == "grad":  # one allreduce of the layer's weight and norm gradients together
            continue
        t[op.phase] += ctx.comm_time(op)
        nbytes[op.kind] = nbytes.get(op.kind, 0) + op.bytes_
    grad = [op for op in ops if op.phase == "grad"]
    if grad:
        t["grad"] = ctx.comm_time(grad_allreduce(sum(op.bytes_ for op in grad), grad[0].layout))
    return t["fwd"], t["bwd"], t["grad"], nbytes


def grad_allreduce(bytes_: int, key: LayerLayout) -> CommOp:
    """The segmented allreduce of `bytes_` of gradients among ranks holding the same shards."""
    return CommOp.placed("allreduce", "grad", bytes_, shard_groups(key), "replica", key)


def weight_layer_cost(node: Node, followers: Sequence[Node], layout: LayerLayout, ctx: CostContext, *,
                      input_grad: bool = True, in_pieces: list[int] | None = None,
                      input_from: tuple[int, ...] | None = (), whole_in: bool = False,
                      joined: bool = False) -> LayerCost:
    """`input_from`: the channel counts of the layers whose split outputs make this layer's input
    (None: it arrives whole, e.g. the model's input or a layer left whole); a conv the runtime leaves
    whole gathers a split input on channel_filter (cost.layout_comm.whole_conv_gathers). `whole_in`:
    the input is a tensor another layer holds whole and needs a gradient (gathered where a split layer
    slices it: cost.layout_comm.whole_grad_gather). `joined`: a whole conv whose output (or what
    elementwise ops, pooling or a mean make of it) meets a split operand in an elementwise join."""
    from hybridpar.cost.layout_comm import norm_gathers, splits_by_layout, whole_conv_gathers, whole_grad_gather

    s, c, f = layout.sample, layout.channel, layout.filter
    # a conv/linear the runtime does not replace (F.linear, a subclass such as attention's out_proj)
    # runs whole on every rank for its sample group's samples, and so do the nodes after it; its
    # parameters are replicated (layer_collectives: their gradients summed over the sample groups)
    split = splits_by_layout(node)
    local = layout if split else LayerLayout(sample=s)
    dist = Distribution(s, local.channel * local.filter)
    g = local.channel * local.filter
    # split over channel/filter: the runtime's own layer as `hybridpar profile` timed it (wrapper,
    # autograd Function, buffers; its collectives apart), else the plain op plus the per-layer overhead
    variant = variant_name(node.op, local.channel, local.filter, node.bwd_data_flops > 0) if g > 1 else None
    # op_time cuts C and F to ceil(dim / pieces); a whole layer under a channel/filter layout computes
    # on the runtime's gathered (NCHW) tensors, not the model's own
    t = ctx.op(node, s, 1.0 / local.channel, 1.0 / local.filter, variant, as_model=c * f == 1)
    as_run = t.source.endswith(f":{variant}")
    ffwd, fbwd = nodes_time(followers, dist, ctx)
    ofwd, obwd = ctx.runtime_overhead(len(followers) + (0 if as_run else 1), c * f, int(g > 1 and not as_run))
    ffwd, fbwd = ffwd + ofwd, fbwd + obwd
    ops = layout_collectives(node, followers, layout, ctx, input_grad=input_grad, in_pieces=in_pieces)
    # an input piece is empty where a producer has fewer channels than pieces: it was gathered whole
    # (runtime.dtensors.settle)
    split_in = input_from is not None and all(piece_sizes(ch, c * f)[-1] > 0 for ch in input_from)
    moves = [op for shape in _whole_meets_split(node, followers, split, whole_in, joined)
             for op in whole_grad_gather(shape, layout, dtype_bytes=ctx.elem)]
    moves += norm_gathers(node, followers, layout, head_split=split, dtype_bytes=ctx.elem)
    for op in whole_conv_gathers(node, layout, input_split=split_in, dtype_bytes=ctx.elem) + moves:
        groups, key = _groups_of(op.group, layout)
        ops.append(CommOp.placed(op.kind, op.phase, op.bytes_, groups, op.group, key))
    cf, cb, grad, nbytes = _summarise(ops, ctx)
    mem = weight_layer_memory(node, followers, local, batch=ctx.batch, elem=ctx.elem, optimizer=ctx.optimizer,
                              momentum=ctx.momentum, input_grad=input_grad, kept=ctx.kept)
    if ctx.cluster.device.kind == "cpu":  # ATen's unfolded convolutions (cost.memory.cpu_unfold_bytes)
        mem = with_cpu_unfold(mem, [node, *followers], local, ctx.batch, ctx.elem)
    grad_bytes = sum(op.bytes_ for op in ops if op.phase == "grad")
    k = ctx.measured_factor(c, f)
    return LayerCost((t.fwd_s + ffwd) * k, (t.bwd_s + fbwd) * k, cf, cb, grad, mem.persistent_bytes, nbytes, grad_bytes,
                     layout_of(s, c * f), mem.transient_bytes, mem,
                     tuple((op.kind, op.group_size, op.bytes_) for op in moves))


def _whole_meets_split(node: Node, followers: Sequence[Node], split: bool, whole_in: bool, joined: bool):
    """Shapes at which a whole tensor (DTensor: Replicate on channel_filter) has its gradient
    gathered in this layer's backward (cost.layout_comm.whole_grad_gather): a split layer's input
    that arrives whole and needs a gradient (`whole_in`); a whole conv's output where a batch norm
    after it takes its channel piece; a whole conv whose output meets a split operand in an
    elementwise join further on (`joined`: gathered at its output). None where the layer runs no
    backward."""
    if node.attr("dead_end"):
        return []
    if split:
        return [node.in_shapes[0]] if whole_in else []
    if node.op != "conv2d":
        return []
    bn = next((f for f in followers if f.op == "batchnorm"), None)
    return ([bn.in_shapes[0]] if bn is not None else []) + ([node.out_shape] if joined else [])


def join_cost(node: Node, followers: Sequence[Node], dist: Distribution, ctx: CostContext,
              whole: bool = False, split_inputs: bool = True, input_grad: bool = True) -> LayerCost:
    """`whole`: every input is whole on channel_filter (from layers the runtime leaves whole), so
    DTensor runs the join whole on each rank of a sample group. `split_inputs`: every input is split
    on channel_filter, so a concatenation along channels is the runtime's all-to-all in the sample
    group (hybridpar.cost.layout_comm.channel_concat; mixed inputs go through DTensor's rules)."""
    from hybridpar.cost.layout_comm import channel_concat, norm_gathers

    run = Distribution(dist.sample, 1) if whole else dist
    t = ctx.op(node, run.sample, piece_frac(channels_of(node.out_shape), run.channel), as_model=dist.channel == 1)
    ffwd, fbwd = nodes_time(followers, run, ctx)
    ofwd, obwd = ctx.runtime_overhead(1 + len(followers), dist.channel)
    ffwd, fbwd = ffwd + ofwd, fbwd + obwd
    mem = dist_memory([node, *followers], run, ctx)
    ops: list[CommOp] = []
    # an input with an empty channel piece (fewer channels than pieces, torch.chunk's short tail) was
    # gathered whole by the layer that made it (runtime.dtensors.settle): DTensor's rules run the join
    if node.op == "concat" and dist.channel > 1 and split_inputs and not whole \
            and all(piece_sizes(s[1], dist.channel)[-1] > 0 for s in node.in_shapes if len(s) > 1):
        lay = layout_of(dist.sample, dist.channel)
        for op in channel_concat(node, dist.sample, dist.channel, 0, input_grad, ctx.elem):
            groups, key = _groups_of(op.group, lay)
            ops.append(CommOp.placed(op.kind, op.phase, op.bytes_, groups, op.group, key))
    ops += nodes_collectives(followers, dist, ctx, input_grad)
    lay = layout_of(dist.sample, dist.channel)
    # the join itself is split unless its inputs are whole (`whole` can be its last follower's: a norm)
    moves = norm_gathers(node, followers, lay, head_split=not whole or split_inputs, head_grad=input_grad,
                         dtype_bytes=ctx.elem)
    for op in moves:  # a layer or RMS norm's input gathered (DTensor's, listed as moves for api.plan)
        groups, key = _groups_of(op.group, lay)
        ops.append(CommOp.placed(op.kind, op.phase, op.bytes_, groups, op.group, key))
    cf, cb, _, nbytes = _summarise(ops, ctx)
    k = ctx.measured_factor(dist.channel, exact=False)
    return LayerCost((t.fwd_s + ffwd) * k, (t.bwd_s + fbwd) * k, cf, cb, 0.0, mem.persistent_bytes, nbytes, memory=mem,
                     dtensor_moves=tuple((op.kind, op.group_size, op.bytes_) for op in moves))


def nodes_collectives(nodes: Sequence[Node], dist: Distribution, ctx: CostContext,
                      input_grad: bool = True) -> list[CommOp]:
    """The collectives, but gradient sums, of nodes that run on a vertex's distribution (a join's
    followers, the nodes before the first layer): a batch norm's statistics. Their gradients are
    summed with the other parameters outside weight layers (planner._outside_grad_bytes).
    `input_grad`: whether the first node's input needs a gradient (then every later node's does)."""
    from hybridpar.cost.layout_comm import layer_collectives

    lay = layout_of(dist.sample, dist.channel)
    ops = []
    for n in nodes:
        for op in layer_collectives(n, lay, input_grad=input_grad, bn_stats=ctx.bn_stats, dtype_bytes=ctx.elem):
            if op.phase != "grad":
                groups, key = _groups_of(op.group, lay)
                ops.append(CommOp.placed(op.kind, op.phase, op.bytes_, groups, op.group, key))
        input_grad = input_grad or bool(n.param_shapes)
    return ops


def nodes_comm(nodes: Sequence[Node], dist: Distribution, ctx: CostContext,
               input_grad: bool = True) -> tuple[float, float, dict[str, int]]:
    """Forward and backward seconds and bytes per kind of `nodes_collectives`."""
    cf, cb, _, nbytes = _summarise(nodes_collectives(nodes, dist, ctx, input_grad), ctx)
    return cf, cb, nbytes


def dist_memory(nodes: Sequence[Node], dist: Distribution, ctx: CostContext) -> LayerMemory:
    """Memory of nodes that run on a vertex's distribution outside a weight layer's layout: a join and
    its followers, or the nodes before the first layer on the first vertex's (their parameters whole
    but for batch norms' channel pieces, a recurrent layer's activations whole for the rank's samples;
    `node_time`'s rule, hybridpar.cost.memory.nodes_memory)."""
    mem = nodes_memory(nodes, batch=ctx.batch, sample=dist.sample, pieces=dist.channel, elem=ctx.elem,
                       optimizer=ctx.optimizer, momentum=ctx.momentum, kept=ctx.kept)
    if ctx.cluster.device.kind == "cpu":  # ATen's unfolded 1-D/3-D convolutions (cost.memory.cpu_unfold_bytes)
        mem = with_cpu_unfold(mem, nodes, LayerLayout(sample=dist.sample, channel=dist.channel), ctx.batch, ctx.elem)
    return mem


def redistribution(tensor_numel: int, src: Distribution, dst: Distribution, ctx: CostContext) -> CommOp | None:
    """The all-to-all that moves a boundary tensor between distributions (None when they agree).

    Each rank holds numel/G of the tensor before and after; the two layouts' rank sets interleave, so
    the exchange is one all-to-all over all G ranks (only in the planner's free space: the runtime's
    layouts share one distribution and never redistribute)."""
    if src == dst:
        return None
    per_rank = tensor_numel // ctx.ranks * ctx.elem
    return CommOp.placed("alltoall", "fwd", per_rank, (tuple(range(ctx.ranks)),), "world",
                         layout_of(ctx.ranks))


def redistribution_time(tensor_numel: int, src: Distribution, dst: Distribution, ctx: CostContext) -> float:
    """Forward redistribution of the activation and backward of its gradient (same volume)."""
    op = redistribution(tensor_numel, src, dst, ctx)
    return 0.0 if op is None else 2 * ctx.comm_time(op)
