"""One rank's view of a model under a uniform spatial layout (depth/height/width splits, with sample),
and the time of its halo exchanges: the cost rule of hybridpar.parallel.styles.spatial(_layers).

The runtime runs a spatial layout only uniformly (every layer under the one `sample=S,height=H,...`
layout). A rank then holds B/S samples of every activation, cut along each split spatial dim to its
torch.chunk piece (the first piece is the largest: ceil(size / parts)); tensors without those dims
(after a flatten or a global pooling) whole, their ops computed on every spatial rank for its samples,
as are the ops the runtime runs on the gathered input (`gathered`: an adaptive pool to more than 1).
Every convolution or pooling first builds its input window (the piece, the halo rows the neighbours
send and the edge padding, concatenated into a new tensor) and runs on it with no padding along the
split dims; for backward it keeps only its input piece (which the producer keeps anyway) and the halo
rows it received, and re-assembles the window from them (`_HaloOp`); a max pool recomputes its
indices there. The window itself lives only while the op runs (forward, and again in its backward).

`local_graph` writes this as a graph the sample-parallel rules price unchanged: every shape at its
piece, a `halo` node before each sliding-window op (priced as an elementwise copy of the window; for
memory, with `window_freed`, a view of the piece keeping `kept_numel` elements: its halo rows), and the batch
multiplied by the spatial ranks P, so that `sample = S x P` gives each rank B/S samples of the pieces
and sums weight gradients and batch-norm statistics over all S x P ranks, as the runtime's
`stats_group` does. FLOPs scale with the output elements a rank computes; a piece's measured time is
the whole layer's, scaled the same way (the SPATIAL_WHOLE_SHAPES attribute: cost.compute.op_time).
"""

from __future__ import annotations

import dataclasses
from itertools import product
from math import ceil, prod

from hybridpar.cluster.model import Cluster
from hybridpar.graph.types import Graph, Node
from hybridpar.layout.halo import SPATIAL_DIMS, Window, coords_of, halo_plan, split_dims
from hybridpar.layout.layer import ORDER, LayerLayout
from hybridpar.layout.pieces import piece_offsets, piece_sizes

SLIDING = ("conv2d", "conv", "maxpool", "avgpool")  # ops that read a window of their input (graph.ops kinds)
# the attribute local_graph gives a node cut to its spatial piece: (input shapes, output shape) of the
# whole layer at the piece's batch, for cost.compute.op_time to derive the piece's time from a measured
# record of the whole layer (`hybridpar profile --model` times whole layers' shapes only)
SPATIAL_WHOLE_SHAPES = "spatial_whole_shapes"
# the attribute of a pooling the runtime splits spatially: its backward re-runs the pooling on the
# re-assembled window first (parallel.styles.spatial._PoolOp keeps neither window nor indices), so its
# backward costs a forward more (cost.compute.op_time)
RECOMPUTES_FORWARD = "recomputes_forward"
# the window copy local_graph adds before a sliding op: priced as an elementwise copy; for memory (the
# "window_freed" and "kept_numel" attributes cost.memory reads) its op keeps the piece it was built from
# and the halo rows it received
HALO_OP = "pointwise"


def model_ndim(graph: Graph) -> int:
    """Spatial dims of the model's (first) input: 2 for N C H W images, 3 for N C D H W volumes."""
    first = next((n for n in graph.nodes if n.op == "input"), None)
    return max(0, len(first.out_shape) - 2) if first is not None and first.out_shape else 0


def spatial_dims(layout: LayerLayout, nd: int) -> list[tuple[int, int]]:
    """(tensor dim, parts) of each split dim of an N C *spatial activation (ValueError: a split the
    model does not have, e.g. depth on images)."""
    return split_dims({k: getattr(layout, k) for k in SPATIAL_DIMS}, nd)


def _piece_shape(shape: tuple[int, ...], dims: list[tuple[int, int]], nd: int, batch: int, p: int) -> tuple[int, ...]:
    if not shape or shape[0] != batch:
        return shape
    out = [batch * p, *shape[1:]]
    if len(shape) == 2 + nd:
        for d, parts in dims:
            out[d] = ceil(shape[d] / parts)
    return tuple(out)


def _window_rows(node: Node, d: int, size: int, parts: int) -> tuple[int, int]:
    """(rows of the input window the first rank's output piece reads along tensor dim `d`: its piece, its
    halo and the edge padding; of those, the halo rows it receives from the others), torch.chunk's
    first piece being the largest."""
    k, s, p, dil = (node.attr(a) for a in ("kernel", "stride", "padding", "dilation"))
    i = d - 2
    own = ceil(size / parts)
    if node.attr("transposed"):  # output row j reads input rows i with i*s + t*dil = j + p (spatial_layers)
        extra = int(node.attr("output_padding", (0,) * 3)[i] or 0)
        out = (size - 1) * s[i] - 2 * p[i] + dil[i] * (k[i] - 1) + extra + 1
        o1 = ceil(out / parts)
        rows = max(0, min(size, (o1 - 1 + p[i]) // s[i] + 1))
        return rows, max(0, rows - own)
    plan = halo_plan(Window(size, k[i], s[i], p[i], dil[i]), parts)
    a, b = plan.window[0]
    return b - a, plan.rows_received(0)


def _rank_window(node: Node, d: int, size: int, parts: int, r: int) -> tuple[int, int]:
    """(rows of the input window rank `r`'s output piece reads along tensor dim `d`, unclipped for a
    convolution (its edge padding included, as the runtime builds it); of those, the halo rows it
    receives). A middle rank receives rows from both neighbours."""
    if not node.attr("transposed"):
        plan = halo_plan(Window(size, *(node.attr(a)[d - 2] for a in ("kernel", "stride", "padding", "dilation"))),
                         parts)
        a, b = plan.window[r]
        return max(0, b - a), plan.rows_received(r)
    k, s, p, dil = (node.attr(a)[d - 2] for a in ("kernel", "stride", "padding", "dilation"))
    extra = int(node.attr("output_padding", (0,) * 3)[d - 2] or 0)
    out = (size - 1) * s - 2 * p + dil * (k - 1) + extra + 1
    o_a, o_n = piece_offsets(out, parts)[r], piece_sizes(out, parts)[r]
    if o_n == 0:
        return 0, 0
    # output row j reads input rows i with i*s + t*dil = j + p (spatial_layers), clipped to the tensor
    lo, hi = max(0, -(-(o_a + p - dil * (k - 1)) // s)), min(size - 1, (o_a + o_n - 1 + p) // s)
    rows = max(0, hi - lo + 1)
    in_a, in_n = piece_offsets(size, parts)[r], piece_sizes(size, parts)[r]
    own = max(0, min(hi + 1, in_a + in_n) - max(lo, in_a))
    return rows, rows - own


def _kept_numel(node: Node, piece: tuple[int, ...], dims: list[tuple[int, int]], graph_input: bool) -> int:
    """Elements a spatially split op keeps for backward besides its input piece (whose producer keeps
    it): the halo rows each exchange received (hybridpar.parallel.styles.spatial._HaloOp; an exchange
    along a later dim moves rows of the window the earlier ones extended), and the piece itself when it
    is the model's input (a copy cut from the whole batch). On the rank that keeps the most (a middle
    rank receives from both sides), each dim's piece taken at its largest (torch.chunk's first)."""
    per_dim = [(d, sorted({_rank_window(node, d, node.in_shapes[0][d], parts, r) for r in range(parts)}))
               for d, parts in dims]
    best = 0
    for combo in product(*(rows for _, rows in per_dim)):  # a few distinct (rows, received) per dim
        window, kept = list(piece), 0
        for (d, _), (rows, received) in zip(per_dim, combo):
            kept += prod(window[:d]) * received * prod(window[d + 1:])
            window[d] = rows
        best = max(best, kept)
    return best + (prod(piece) if graph_input else 0)


def _sliding(node: Node, nd: int) -> bool:
    return node.op in SLIDING and bool(node.in_shapes) and len(node.in_shapes[0]) == 2 + nd \
        and node.attr("kernel") is not None


# the class the spatial runtime wraps as an upsampling (spatial_layers.spatial_wraps: the exact type)
UPSAMPLE_CLASS = "torch.nn.modules.upsampling.Upsample"


def gathered(node: Node, layout: LayerLayout) -> bool:
    """Whether the runtime runs `node` on the spatially whole input on every spatial rank: an
    adaptive max pool, an adaptive average pool to more than 1 along any dim, split or not, an
    nn.Upsample other than nearest by integer factors (parallel.styles.spatial_layers.SpatialGathered),
    and any other upsampling (F.interpolate, nn.UpsamplingBilinear2d, which run through DTensor, whose
    rule for them shards samples and channels only); DTensor gathers the input over the spatial ranks
    first. The graph has no class for pools: an nn.AdaptiveXPoolNd module's node (as
    search.layers.spatial_plan's global average pooling rule); an upsampling's class and interpolation
    are recorded (graph.ops._upsample_attrs)."""
    if not node.in_shapes or len(node.in_shapes[0]) < 3:
        return False
    if node.op == "adaptive_avgpool" and node.module:
        whole = bool(node.attr("max")) or any(o != 1 for o in node.out_shape[2:])
    elif node.attr("upsample_mode") is not None:
        scale = node.attr("upsample_scale")
        whole = not (node.attr("module_class") == UPSAMPLE_CLASS and node.attr("upsample_mode") == "nearest"
                     and not node.attr("upsample_size") and scale is not None
                     and all(float(v).is_integer() for v in scale))
    else:
        return False
    try:
        split = [d for d, _ in spatial_dims(layout, len(node.in_shapes[0]) - 2)]
    except ValueError:
        return False
    return bool(split) and whole


def regathered(node: Node, layout: LayerLayout) -> bool:
    """Whether the gradient of a `gathered` node's output is gathered in backward: its output, whole
    over the spatial dims, is a spatial activation the next layers split again (a U-Net's bilinear
    upsampling before a conv or a skip concatenation: DTensor's Replicate -> Shard, whose backward
    allgathers the gradient), and its input needs a gradient. An adaptive pool's output goes to a
    flatten and the head, whole: none."""
    return gathered(node, layout) and node.op != "adaptive_avgpool" and node.bwd_data_flops > 0 \
        and len(node.out_shape) == len(node.in_shapes[0])


def gather_moves(node: Node, layout: LayerLayout, elem: int = 4) -> list[tuple[int, int]]:
    """(group size, bytes) of each allgather DTensor sends to make `node`'s input spatially whole
    (`gathered`), on one rank, as hybridpar.parallel.dtensor.log records them (the padded piece times
    the group): one per split mesh dim, the innermost (last in layout.ORDER) first, the piece growing
    to the whole along each dim in turn; the sample dim stays split (B/S samples). Its backward
    (Replicate to Shard) is a local slice: no bytes. `backward_moves` has the output gradient's."""
    return _gathers(node.in_shapes[0], layout, elem)


def backward_moves(node: Node, layout: LayerLayout, elem: int = 4) -> list[tuple[int, int]]:
    """(group size, bytes) of each allgather of the output's gradient in backward (`regathered`), as
    `gather_moves` counts them, of the output's shape; none when it is not regathered."""
    return _gathers(node.out_shape, layout, elem) if regathered(node, layout) else []


def _gathers(x: tuple[int, ...], layout: LayerLayout, elem: int) -> list[tuple[int, int]]:
    dims = spatial_dims(layout, len(x) - 2)
    local = [ceil(x[0] / layout.sample), *x[1:]]
    for d, parts in dims:
        local[d] = ceil(x[d] / parts)
    out = []
    for d, parts in reversed(dims):
        out.append((parts, prod(local) * parts * elem))
        local[d] = x[d]
    return out


def local_graph(graph: Graph, layout: LayerLayout) -> Graph:
    """`graph` (shapes at its global batch) as the first rank of the uniform spatial `layout` holds
    it, at batch graph.batch x P (module docstring). ValueError for a split the model lacks."""
    nd = model_ndim(graph)
    dims = spatial_dims(layout, nd)
    b, p = graph.batch, layout.spatial
    nodes: list[Node] = []
    inputs_of_graph = {n.name for n in graph.nodes if n.op == "input"}
    for n in graph.nodes:
        cut = [] if gathered(n, layout) else dims  # run on the whole input, its output whole (gather_moves)
        out = _piece_shape(n.out_shape, cut, nd, b, p)
        ins = tuple(_piece_shape(s, cut, nd, b, p) for s in n.in_shapes)
        inputs = n.inputs
        attrs = _attrs_as_run(n, layout)
        entire = (tuple(_piece_shape(s, [], nd, b, p) for s in n.in_shapes), _piece_shape(n.out_shape, [], nd, b, p))
        if (ins, out) != entire:  # a piece: priced from the whole layer's measured time (cost.compute.op_time)
            attrs = (*attrs, (SPATIAL_WHOLE_SHAPES, entire))
        if _sliding(n, nd) and n.inputs:
            ext = list(ins[0])
            for d, parts in dims:
                ext[d] = _window_rows(n, d, n.in_shapes[0][d], parts)[0]
            # _HaloOp keeps the piece and the halo rows, not the window, except (channel/filter too) a
            # convolution's input: SpatialDistConv keeps its window, the others their input gathered
            # over channels, about a window each (cost.memory's rules, with the "window_freed" attribute)
            freed = layout.g_size == 1 or n.op in ("maxpool", "avgpool")
            kept = _kept_numel(n, ins[0], dims, n.inputs[0] in inputs_of_graph) if freed else 0
            halo = Node(f"{n.name}__halo", HALO_OP, (n.inputs[0],), (ins[0],), tuple(ext),
                        attrs=(("scope", n.attr("scope")), ("saves", "nothing"), ("halo", True),
                               ("window_freed", freed), ("kept_numel", kept)))
            nodes.append(halo)
            inputs, ins = (halo.name, *n.inputs[1:]), (tuple(ext), *ins[1:])
            if n.op in ("maxpool", "avgpool"):
                attrs = (*attrs, (RECOMPUTES_FORWARD, True))
            if n.op == "maxpool":  # recomputed in backward from the piece and its halo rows: no indices kept
                attrs = (*attrs, ("indices", False))
            elif freed and n.op != "avgpool":  # a convolution's backward re-assembles its window (a transient)
                attrs = (*attrs, ("rebuilds_window", True))
        whole = prod(n.out_shape) if n.out_shape else 0
        k = prod(out) / whole if whole else p
        nodes.append(dataclasses.replace(n, inputs=inputs, in_shapes=ins, out_shape=out, attrs=attrs,
                                         fwd_flops=int(n.fwd_flops * k), bwd_data_flops=int(n.bwd_data_flops * k),
                                         bwd_weight_flops=int(n.bwd_weight_flops * k)))
    return dataclasses.replace(graph, nodes=tuple(nodes), batch=b * p)


def proxy_layout(layout: LayerLayout) -> LayerLayout:
    """The layout that prices `layout` on its `local_graph` (the planner's time and memory, and
    cost.memory.predict_rank_memory's, which `hybridpar train` checks against): the S x P sample x
    spatial ranks as sample groups (each holds B/S samples of one spatial piece; weight gradients and
    batch-norm statistics summed over all of them), with the layout's channel x filter split of each
    piece. Ranks are row-major over layout.ORDER (channel, filter innermost), so its channel and filter
    groups are the runtime's, and a conv's input there is its halo window: the filter group gathers
    the extended piece, as SpatialDistConv does (cost.layout_comm.spatial_conv_collectives)."""
    return LayerLayout(sample=layout.sample * layout.spatial, channel=layout.channel, filter=layout.filter,
                       zero=layout.zero)


# marks a Linear the runtime leaves whole under spatial x channel/filter (parallel.styles.table.style_for
# gives nn.Linear no style there: it runs through DTensor, its parameters replicated); not a class name
SPATIAL_WHOLE = "hybridpar:whole-under-spatial:"

# graph.ops kinds whose parameters a spatial style holds, their gradients summed over the stats group
# (sample x spatial ranks); any other parameter (a Linear head's, free parameters) is left to DTensor,
# replicated, its gradient summed over the sample groups only
_SPATIAL_PARAM_OPS = ("conv2d", "conv", "batchnorm")


def _attrs_as_run(n: Node, layout: LayerLayout) -> tuple:
    """`n`'s attributes as the runtime runs it under the spatial `layout`: a Linear whole under channel/filter
    (cost.layout_comm.splits_by_layout False), and under sample = 1 a parameter no spatial style holds
    with no gradient sum (every spatial rank computes it alike on the spatially whole tensor:
    cost.layout_comm.layer_collectives reads "grad_summed")."""
    from hybridpar.cost.layout_comm import splits_by_layout

    attrs = n.attrs
    if layout.g_size > 1 and n.op == "linear" and splits_by_layout(n):
        attrs = tuple((k, SPATIAL_WHOLE + str(v) if k == "module_class" else v) for k, v in attrs)
    if layout.sample == 1 and n.params and n.op not in _SPATIAL_PARAM_OPS:
        attrs = (*attrs, ("grad_summed", False))
    return attrs


# -- halo exchange time ---------------------------------------------------------------------------

def _rank(layout: LayerLayout, coords: dict[str, int]) -> int:
    r = 0
    for k in ORDER:
        r = r * getattr(layout, k) + coords.get(k, 0)
    return r


def _slowest_links(layout: LayerLayout, cluster: Cluster) -> dict[str, tuple[float, float]]:
    """Per split dim, (latency s, bandwidth B/s) of the slowest link between neighbours along it in
    sample group 0: all exchanges of a layer run at once, so the slowest pair sets the pace."""
    hit = _LINKS.get((layout, id(cluster)))
    if hit is not None and hit[0] is cluster:
        return hit[1]
    out: dict[str, tuple[float, float]] = {}
    ranks = layout.spatial * layout.g_size
    for name in SPATIAL_DIMS:
        deg = getattr(layout, name)
        if deg == 1:
            continue
        stride = prod(getattr(layout, k) for k in ORDER[ORDER.index(name) + 1:])
        pairs = [(r, r + stride) for r in range(ranks)
                 if (r // stride) % deg < deg - 1]
        out[name] = min(((cluster.p2p_latency_s(a, b), cluster.p2p_bw_Bps(a, b)) for a, b in pairs),
                        key=lambda lb: (lb[1], -lb[0]))
    _LINKS[(layout, id(cluster))] = (cluster, out)
    return out


_LINKS: dict[tuple[LayerLayout, int], tuple[Cluster, dict[str, tuple[float, float]]]] = {}


def _rank_classes(layout: LayerLayout) -> list[int]:
    """Ranks of sample group 0 standing for all along each split dim: the edges, their neighbours and
    the middle (an interior rank with whole neighbours sends the most; every rank would cost
    O(parts) exchanges per layer and layout). Approximation: where pieces are uneven, a rank in the
    middle of torch.chunk's short tail may send more and is not sampled."""
    per_dim: dict[str, list[int]] = {}
    for name in SPATIAL_DIMS:
        deg = getattr(layout, name)
        per_dim[name] = sorted({c for c in (0, 1, deg // 2, deg - 2, deg - 1) if 0 <= c < deg})
    out: list[dict[str, int]] = [{}]
    for name, cs in per_dim.items():
        out = [{**o, name: c} for o in out for c in cs]
    return [_rank(layout, c) for c in out]


def halo_cost(node: Node, layout: LayerLayout, cluster: Cluster, elem: int = 4) -> tuple[float, float, int, int]:
    """(forward s, backward s, forward bytes, backward bytes) of `node`'s halo exchanges
    (cost.layout_comm.halo_collectives: bytes = what the runtime sends) on the rank of sample group 0
    that takes longest. Each exchange is point-to-point with the rank's neighbours along one split
    dim, both directions at once (the bytes halved between two neighbours), on the slowest link
    between neighbours along that dim, one dim after the other, and not overlapped with the
    convolution (the runtime waits for the halo before computing)."""
    from hybridpar.cost.layout_comm import halo_collectives

    key = (node.op, node.in_shapes[:1], *(node.attr(a) for a in ("kernel", "stride", "padding", "dilation",
                                                                  "transposed")), layout, id(cluster), elem)
    hit = _HALO.get(key)
    if hit is not None and hit[0] is cluster:  # ResNet-50's 16 bottlenecks have a few distinct shapes
        return hit[1]
    links = _slowest_links(layout, cluster)
    # sample group 0's exchanges, of the whole batch's rows divided by the sample degree (bytes are
    # linear in the rank's samples, B/S of them: torch.chunk of a divisible batch), without building
    # the S pieces of the batch per call (S in the hundreds: the planner's hot spot)
    s = layout.sample if node.in_shapes and node.in_shapes[0][0] % layout.sample == 0 else 1
    one = layout.model_copy(update={"sample": layout.sample // s})
    worst = (0.0, 0.0, 0, 0)
    for rank in _rank_classes(one):
        fwd = bwd = 0.0
        fb = bb = 0
        for full in halo_collectives(node, one, rank=rank, dtype_bytes=elem):
            op = dataclasses.replace(full, bytes_=full.bytes_ // s)
            sides = len(_neighbours(layout, rank, op.group))
            lat, bw = links[op.group]
            t = lat + op.bytes_ / sides / bw if op.bytes_ else 0.0
            if op.phase == "fwd":
                fwd, fb = fwd + t, fb + op.bytes_
            else:
                bwd, bb = bwd + t, bb + op.bytes_
        if (fwd + bwd, fb + bb) > (worst[0] + worst[1], worst[2] + worst[3]):
            worst = (fwd, bwd, fb, bb)
    _HALO[key] = (cluster, worst)
    return worst


_HALO: dict[tuple, tuple[Cluster, tuple[float, float, int, int]]] = {}


def _neighbours(layout: LayerLayout, rank: int, name: str) -> list[int]:
    """The ranks next to `rank` along spatial dim `name` (row-major over layout.ORDER)."""
    degrees = {k: getattr(layout, k) for k in ORDER}
    coords = coords_of(degrees, rank, ORDER)
    stride = prod(degrees[k] for k in ORDER[ORDER.index(name) + 1:])
    return [rank + dc * stride for dc in (-1, 1) if 0 <= coords[name] + dc < degrees[name]]
