"""Which module owns each trainable parameter of a graph, node by node.

The tracer gives every trainable parameter to exactly one node (its first use; a parameter no op
reads goes to the first node of its innermost module, `hybridpar.graph.build`), so grouping each
node's parameters by the module that owns them lists every parameterised module once: weight
layers, norms, embeddings, recurrent and attention layers, layer scales, position tables and the
root module's free parameters (owner "").
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from hybridpar.graph.types import Graph, Node


@dataclass(frozen=True)
class ParamGroup:
    """The parameters of one module that one node holds."""

    module: str  # qualified name of the module owning them ("" = the root module)
    node: str
    op: str
    params: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def numel(self) -> int:
        return sum(prod(s) for _, s in self.params)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.params)


def owner_of(param: str) -> str:
    """'enc.self_attn.in_proj_weight' -> 'enc.self_attn'; a root parameter 'cls_token' -> ''."""
    return param.rpartition(".")[0]


def node_param_groups(node: Node) -> tuple[ParamGroup, ...]:
    """`node`'s parameters grouped by owning module, in the order they first appear."""
    by_owner: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in node.param_shapes:
        by_owner.setdefault(owner_of(name), []).append((name, tuple(shape)))
    return tuple(ParamGroup(m, node.name, node.op, tuple(ps)) for m, ps in by_owner.items())


def param_groups(graph: Graph) -> tuple[ParamGroup, ...]:
    """Every node's parameters grouped by owning module, in graph order; a parameter listed by
    several nodes (time chunks of an unrolled recurrent layer) counts at its first."""
    seen: set[str] = set()
    out = []
    for n in graph.nodes:
        fresh = Node(n.name, n.op, param_shapes=tuple(p for p in n.param_shapes if p[0] not in seen))
        seen.update(p[0] for p in n.param_shapes)
        out += node_param_groups(fresh)
    return tuple(out)


def placed_param_listing(graph: Graph, devices, elem: int) -> list[dict]:
    """Every parameterised module of a placed graph (`devices[i]`: the device of node i), each with
    its gradient bytes: whole on the device that runs it, what data parallelism over copies of the
    placement allreduces (JSON-ready rows)."""
    device_of = {n.name: int(d) for n, d in zip(graph.nodes, devices)}
    return [{"module": g.module, "node": g.node, "op": g.op, "params": list(g.names), "numel": g.numel,
             "device": device_of[g.node], "grad_bytes": g.numel * elem} for g in param_groups(graph)]
