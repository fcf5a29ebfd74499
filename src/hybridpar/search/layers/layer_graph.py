"""The planner's coarse view of a graph: weight layers and joins, each with the nodes it feeds alone.

Every conv2d/linear node and every node joining two layers' outputs (add, concat, ...) is a vertex;
any other node (batch norm, ReLU, pooling, flatten, loss) runs on the distribution of the vertex that
produces its input and is folded into it as a *follower*. Edges carry the boundary tensor crossing
them (per-sample element count), which a redistribution would move.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from hybridpar.cost.memory import WEIGHT_OPS, layer_groups
from hybridpar.graph.types import Graph, Node


@dataclass(frozen=True)
class Vertex:
    node: Node
    followers: tuple[Node, ...]
    # False when nothing upstream has trainable parameters (the model's input alone): autograd
    # computes no gradient of this layer's input (no backward-data work, no reduce-scatter of dx)
    input_grad: bool = True

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def is_weight(self) -> bool:
        return self.node.op in WEIGHT_OPS

    @property
    def out_node(self) -> Node:
        """The node whose output leaves this vertex (its last follower, or itself)."""
        return self.followers[-1] if self.followers else self.node


@dataclass(frozen=True)
class LayerEdge:
    src: int
    dst: int
    per_sample_numel: int  # elements of one sample of the tensor crossing the edge


@dataclass(frozen=True)
class LayerGraph:
    vertices: tuple[Vertex, ...]
    edges: tuple[LayerEdge, ...]
    graph: Graph | None = None  # the node graph it was built from
    # nodes before the first layer (on the graph's inputs alone: an embedding, recurrent layers over
    # it): they run on the first vertex's distribution
    prefix: tuple[Node, ...] = ()


def _per_sample(shape: tuple[int, ...]) -> int:
    return prod(shape[1:]) if len(shape) > 1 else 1


def build_layer_graph(graph: Graph) -> LayerGraph:
    """The layers of hybridpar.cost.memory.layer_groups (predict_rank_memory's grouping and its
    input-gradient rule, one function) with the boundary tensors between them."""
    heads, prefix = layer_groups(graph)
    owner = {n.name: i for i, (head, followers, _) in enumerate(heads) for n in (head, *followers)}
    edges: dict[tuple[int, int], int] = {}
    for idx, (node, _, _) in enumerate(heads):
        for inp in node.inputs:
            o = owner.get(inp)
            if o is not None:
                edges[(o, idx)] = edges.get((o, idx), 0) + _per_sample(graph.node(inp).out_shape)
    return LayerGraph(tuple(Vertex(n, tuple(f), g) for n, f, g in heads),
                      tuple(LayerEdge(u, v, k) for (u, v), k in sorted(edges.items(), key=lambda e: e[0][::-1])),
                      graph, tuple(prefix))
