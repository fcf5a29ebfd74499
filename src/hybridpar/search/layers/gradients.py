"""Every trainable parameter of a planned model, with the gradient bytes a rank holds and sends.

Each parameter sits with the vertex of the layer graph that runs its node: weight layers
(conv2d/linear) under their layout, the nodes that follow a vertex on that vertex's distribution, the
nodes before the first layer on the first vertex's. Weight layers and batch norms hold the channel
shard their layout gives them; every other parameter (embeddings, recurrent and attention layers,
layer/group norms, layer scales, position tables, free parameters) is whole on every rank. Either way
its gradient is summed over the sample groups, as the runtime does: bytes from
`hybridpar.cost.layout_comm.layer_collectives`, the runtime's analytic twin. The JSON listing and the
prediction's gradient allreduce bytes come from this one rule, so they agree (a test checks it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridpar.cost.layout_comm import layer_collectives, splits_by_layout
from hybridpar.graph.params import node_param_groups
from hybridpar.graph.types import Node
from hybridpar.plans import LayerLayout
from hybridpar.search.layers.decomposition import Distribution, layout_of
from hybridpar.search.layers.layer_graph import LayerGraph

SPLIT_OPS = ("conv2d", "linear", "batchnorm")  # the ops whose parameters a layout shards


@dataclass(frozen=True)
class ParamGradient:
    module: str  # owning module ("" = the root module's own parameters)
    node: str
    op: str
    params: tuple[str, ...]
    numel: int  # elements of these parameters in the whole model
    layout: str  # the layout they are held under ("whole": replicated on every rank)
    grad_bytes: int  # this rank's gradient of them (its shard, on the rank with the largest piece)
    allreduce_bytes: int  # what the step's gradient allreduce sends of them (0 with one sample group)

    def as_dict(self) -> dict:
        return {"module": self.module, "node": self.node, "op": self.op, "params": list(self.params),
                "numel": self.numel, "layout": self.layout, "grad_bytes": self.grad_bytes,
                "allreduce_bytes": self.allreduce_bytes}


def grad_allreduce_bytes(node: Node, lay: LayerLayout, elem: int, bn_stats: str = "global") -> int:
    """Bytes of `node`'s gradient allreduce under `lay` (layout_comm's rule; 0 when sample = 1)."""
    return sum(op.bytes_ for op in layer_collectives(node, lay, bn_stats=bn_stats, dtype_bytes=elem)
               if op.phase == "grad")


def node_gradients(node: Node, lay: LayerLayout, elem: int, bn_stats: str = "global") -> list[ParamGradient]:
    """`node`'s parameters by owning module under `lay`. A sharded layer is one entry under the owner
    of its weight (its shard's bytes are not split between owners)."""
    groups = node_param_groups(node)
    if not groups:
        return []
    if node.attr("grad_summed") is False:  # whole on every rank, computed alike: held, not sent (cost.spatial)
        return [ParamGradient(g.module, g.node, g.op, g.names, g.numel, "whole", g.numel * elem, 0) for g in groups]
    sent = grad_allreduce_bytes(node, lay, elem, bn_stats)
    if node.op == "batchnorm" or (node.op in SPLIT_OPS and splits_by_layout(node)):  # else replicated
        # what this rank holds is what its allreduce would send with more than one sample group
        held = sent if lay.sample > 1 else grad_allreduce_bytes(node, layout_of(2, lay.channel, lay.filter),
                                                               elem, bn_stats)
        weight = next((n for n, _ in node.param_shapes if n.endswith("weight")), node.param_shapes[0][0])
        owner = next(g for g in groups if weight in g.names)
        return [ParamGradient(owner.module, node.name, node.op, tuple(n for g in groups for n in g.names),
                              sum(g.numel for g in groups), lay.to_strategy(), held, sent)]
    # replicated: each whole, all sent or none (sample = 1, or a dead end under channel/filter), or
    # one parameter's piece (layout_comm: a per-channel parameter's gradient split like its activation)
    return [ParamGradient(g.module, g.node, g.op, g.names, g.numel, "whole", g.numel * elem,
                          sent if len(groups) == 1 else g.numel * elem if sent else 0) for g in groups]


def _vertex_layout(option: LayerLayout | Distribution) -> LayerLayout:
    if isinstance(option, LayerLayout):
        return option
    return layout_of(option.sample, option.channel)  # a join's followers: its distribution's channels


def node_layouts(lg: LayerGraph, options: Sequence[LayerLayout | Distribution]) -> dict[str, LayerLayout]:
    """The layout each parameterised node of `lg.graph` runs under, given each vertex's option."""
    out: dict[str, LayerLayout] = {}
    for v, o in zip(lg.vertices, options):
        lay = _vertex_layout(o)
        for n in (v.node, *v.followers):
            if n.param_shapes:
                out[n.name] = lay
    first = _vertex_layout(options[0]) if options else layout_of(1)
    for n in lg.graph.nodes:  # before the first layer (an embedding): on the first vertex's ranks
        if n.param_shapes and n.name not in out:
            out[n.name] = layout_of(first.sample, first.channel * first.filter)
    return out


def gradient_listing(lg: LayerGraph, options: Sequence[LayerLayout | Distribution], elem: int,
                     bn_stats: str = "global") -> tuple[ParamGradient, ...]:
    """Every parameterised node of `lg.graph`, in graph order, with its gradient bytes."""
    lays = node_layouts(lg, options)
    return tuple(g for n in lg.graph.nodes if n.param_shapes for g in node_gradients(n, lays[n.name], elem, bn_stats))


_OUTSIDE: dict[int, tuple[LayerGraph, tuple[tuple[int, Node], ...]]] = {}


def outside_nodes(lg: LayerGraph) -> tuple[tuple[int, Node], ...]:
    """(vertex index, node) of the parameterised nodes that are not priced in a weight vertex's
    LayerCost: followers of joins (index of the join) and nodes before the first layer (index -1).
    Computed once per layer graph (the planner predicts many choices of one graph)."""
    hit = _OUTSIDE.get(id(lg))
    if hit is not None and hit[0] is lg:
        return hit[1]
    seen = {n.name for v in lg.vertices if v.is_weight for n in (v.node, *v.followers)}
    out = []
    for i, v in enumerate(lg.vertices):
        if not v.is_weight:
            for n in (v.node, *v.followers):
                seen.add(n.name)
                if n.param_shapes:
                    out.append((i, n))
    out += [(-1, n) for n in lg.graph.nodes if n.param_shapes and n.name not in seen]
    if len(_OUTSIDE) > 64:
        _OUTSIDE.clear()
    _OUTSIDE[id(lg)] = (lg, tuple(out))
    return _OUTSIDE[id(lg)][1]
