"""The planner's coarse view of a graph: weight layers and joins, each with the nodes it feeds alone.

Every conv2d/linear node and every node joining two layers' outputs (add, concat, ...) is a vertex;
any other node (batch norm, ReLU, pooling, flatten, loss) runs on the distribution of the vertex that
produces its input and is folded into it as a *follower*. Edges carry the boundary tensor crossing
them (per-sample element count), which a redistribution would move.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from hybridpar.graph.types import Graph, Node
from hybridpar.search.layers.layer_cost import JOIN_OPS, WEIGHT_OPS


@dataclass(frozen=True)
class Vertex:
    node: Node
    followers: tuple[Node, ...]
    input_grad: bool = True  # False when the input is the model's (no gradient flows back to it)

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
    owner: dict[str, int | None] = {}
    verts: list[tuple[Node, list[Node], bool]] = []
    edges: dict[tuple[int, int], int] = {}
    prefix: list[Node] = []
    for node in graph.nodes:
        owners = [owner.get(i) for i in node.inputs]
        distinct = sorted({o for o in owners if o is not None})
        if node.op in WEIGHT_OPS or node.op in JOIN_OPS or len(distinct) > 1:
            idx = len(verts)
            verts.append((node, [], bool(distinct)))
            owner[node.name] = idx
            for inp, o in zip(node.inputs, owners):
                if o is not None:
                    numel = _per_sample(graph.node(inp).out_shape)
                    edges[(o, idx)] = edges.get((o, idx), 0) + numel
        elif distinct:
            owner[node.name] = distinct[0]
            verts[distinct[0]][1].append(node)
        else:
            owner[node.name] = None  # graph input and what runs on it before the first layer
            if node.op != "input":
                prefix.append(node)
    return LayerGraph(tuple(Vertex(n, tuple(f), g) for n, f, g in verts),
                      tuple(LayerEdge(u, v, k) for (u, v), k in sorted(edges.items(), key=lambda e: e[0][::-1])),
                      graph, tuple(prefix))
