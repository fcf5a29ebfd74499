"""Time-step unrolling of recurrent graphs for the placer: the wavefront Pal et al. exploit for RNNs.

A graph node for an LSTM layer runs the whole sequence, so two stacked layers on two devices could
only run one after the other. Here every coarse node that works step by step along the sequence
(LSTM layers and the time-wise ops around them: dropout, residual add, concat, linear projections,
embedding; attention runs whole) is split into K time chunks, each with its own time (the node's ops at
the chunk's steps: cost.compute.chunk_time, as adapter prices them) and 1/K of the node's memory and
output bytes. Edges:
  - chunk t -> chunk t+1 of a node holding a recurrent layer (the recurrence: h and c stay on its device);
  - chunk t of u -> chunk t of v when v reads u step for step (the activation, 1/K of the bytes);
  - every chunk of u -> each chunk of v otherwise (v needs u's whole sequence, e.g. attention keys).
All chunks of one coarse node carry the same `tie`, so the placer keeps them on one device (the
runtime places whole modules) but schedules them separately. Backward mirrors these edges in reverse
(the schedule's rules). With layer l on one device and layer l+1 on another, layer l+1 runs chunk t
while layer l runs chunk t+1: the wavefront, found by the ILP.

This is what the MP runtime runs with `time_chunks` K (parallel/pipeline/wavefront.py), in the same
program order (each node's chunks in a row): a stacked recurrent module is first split into one node
per layer ('<node>[<l>]', module '<module>[<l>]', the runtime's per-layer placement key:
`split_layers`), and a node is split when it holds a recurrent layer or reads a split node step for
step (the runtime chunks what follows a recurrent layer, not what precedes it; attention runs whole).

Approximations: a chunk without a profiled record of its shape takes its steps' share of the whole
node's measured time (labelled measured-scaled); bidirectional LSTMs are not split (nor by the
runtime); a softmax is not split (its axis is not recorded); a coarse node mixing ops the runtime
chunks and ops it does not is split whole; the optimizer update is split evenly across the chunks'
backward, and the weight gradients count as ready after the last backward chunk.
"""

from __future__ import annotations

import dataclasses

from hybridpar.graph.recurrent import DEFAULT_TIME_CHUNKS, layer_nodes
from hybridpar.graph.types import Graph, Node

# ops that compute each time step from the same time step of their inputs (last-axis ops, elementwise)
TIMEWISE_OPS = frozenset({"lstm", "dropout", "add", "mul", "pointwise", "relu", "concat", "linear",
                          "layernorm", "embedding"})
# DEFAULT_TIME_CHUNKS (graph.recurrent): the K the placer weighs against whole layers when none is given
# (api._choose_time_chunks, `place --time-chunks`'s help), and K for a bare `project --time-chunks`
WHAT_IF_TIME_CHUNKS = DEFAULT_TIME_CHUNKS  # the old name (no longer a what-if), still imported


def _members(node: Node) -> tuple[str, ...]:
    return tuple(node.attr("members") or (node.name,))


def _splittable_lstm(node: Node) -> bool:
    return node.op == "lstm" and not node.attr("bidirectional")


def _first_sequence(fine: Graph) -> Node | None:
    """The first unidirectional LSTM with a batched sequence output: the wavefront's reference, whose
    leading dims every chunked node shares (`_timewise`)."""
    return next((n for n in fine.nodes if _splittable_lstm(n) and len(n.out_shape) >= 3), None)


def sequence_shape(fine: Graph) -> tuple[int, int] | None:
    """The leading (batch, steps) of the first unidirectional LSTM ((steps, batch) when sequence-first),
    or None when there is none."""
    n = _first_sequence(fine)
    return None if n is None else (n.out_shape[0], n.out_shape[1])


def time_axis(fine: Graph) -> int | None:
    """The time axis the wavefront splits every chunked node along: the first unidirectional LSTM's
    (1 batch-first, else 0); None when there is none."""
    n = _first_sequence(fine)
    return None if n is None else (1 if n.attr("batch_first") else 0)


def has_recurrence(fine: Graph) -> bool:
    return sequence_shape(fine) is not None


def _timewise(node: Node, bt: tuple[int, int]) -> bool:
    if node.op not in TIMEWISE_OPS or len(node.out_shape) < 3 or tuple(node.out_shape[:2]) != bt:
        return False
    return node.op != "lstm" or _splittable_lstm(node)


def _aligned(fine: Graph, u: str, v: str, bt: tuple[int, int]) -> bool:
    """v's step t reads only u's step t. Conservative: any broadcast or reshaped input of v (whose
    in_shape does not start with (batch, steps)) makes every input of v need the whole sequence."""
    nu, nv = fine.node(u), fine.node(v)
    if not (_timewise(nv, bt) and _timewise(nu, bt)):
        return False
    return all(len(s) >= 2 and tuple(s[:2]) == bt for s in nv.in_shapes)


def _chunkable(node: Node, fine: Graph, bt: tuple[int, int]) -> bool:
    """Every member works step by step and every edge inside the node is step for step."""
    mem = set(_members(node))
    if node.op == "input" or not all(_timewise(fine.node(x), bt) for x in mem):
        return False
    return all(_aligned(fine, i, x, bt) for x in mem for i in fine.node(x).inputs if i in mem)


def unroll(coarse: Graph, fine: Graph, chunks: int) -> Graph:
    """`coarse` (a coarsening of `fine`) with its time-wise nodes split into `chunks` tied chunks.

    Chunk nodes are named '<node>#<t>' and keep the node's members and modules (so a placement maps
    back to modules and fine nodes); attrs `tie` (the node's name) and `chunk` ((t, chunks)). Returns
    `coarse` unchanged when chunks < 2 or the graph has no splittable recurrence."""
    bt = sequence_shape(fine)
    if chunks < 2 or bt is None:
        return coarse
    owner = {x: n.name for n in coarse.nodes for x in _members(n)}
    split: set[str] = set()
    for n in coarse.nodes:  # topological: a node follows its split inputs, as the runtime chunks
        if _chunkable(n, fine, bt) and (any(_splittable_lstm(fine.node(x)) for x in _members(n)) or any(
                u in split and _edges_aligned(fine, coarse.node(u), n, owner, bt) for u in n.inputs)):
            split.add(n.name)
    if not any(_splittable_lstm(fine.node(x)) for n in coarse.nodes if n.name in split for x in _members(n)):
        return coarse
    names = {v: [f"{v}#{t}" for t in range(chunks)] if v in split else [v] for v in (n.name for n in coarse.nodes)}
    out: list[Node] = []
    for n in coarse.nodes:
        if n.name not in split:
            inputs = tuple(c for u in n.inputs for c in names[u])
            out.append(dataclasses.replace(n, inputs=inputs))
            continue
        step_for_step = {u: u in split and _edges_aligned(fine, coarse.node(u), n, owner, bt) for u in n.inputs}
        recurrent = any(_splittable_lstm(fine.node(x)) for x in _members(n))
        for t in range(chunks):
            inputs = [names[n.name][t - 1]] if recurrent and t else []
            for u in n.inputs:
                inputs += [names[u][t]] if step_for_step[u] else names[u]
            out.append(_chunk(n, t, chunks, tuple(dict.fromkeys(inputs))))
    return Graph(coarse.name, tuple(out), batch=coarse.batch, meta=coarse.meta + (("time_chunks", chunks),))


def _edges_aligned(fine: Graph, u: Node, v: Node, owner: dict[str, str], bt) -> bool:
    vm = set(_members(v))
    return all(_aligned(fine, x, y, bt) for x in _members(u) for y in fine.successors[x] if y in vm)


def _chunk(node: Node, t: int, k: int, inputs: tuple[str, ...]) -> Node:
    attrs = dict(node.attrs)
    attrs.update(members=_members(node), modules=tuple(node.attr("modules") or
                                                        ((node.module,) if node.module else ())),
                 tie=node.name, chunk=(t, k))
    return dataclasses.replace(node, name=f"{node.name}#{t}", inputs=inputs,
                               param_shapes=node.param_shapes if t == 0 else (),
                               fwd_flops=share(node.fwd_flops, t, k), bwd_data_flops=share(node.bwd_data_flops, t, k),
                               bwd_weight_flops=share(node.bwd_weight_flops, t, k), attrs=tuple(attrs.items()))


def share(total: float, t: int, k: int) -> int:
    """Chunk t's integer share of `total` split K ways (the remainder goes to chunk 0, so shares sum up)."""
    n = int(total)
    return n // k + (n % k if t == 0 else 0)


def tie_name(node: Node) -> str:
    """The coarse node a (chunk) node belongs to."""
    return node.attr("tie") or node.name


def chunk_of(node: Node) -> tuple[int, int]:
    """(t, K) of a chunk node; (0, 1) for an unsplit node."""
    c = node.attr("chunk")
    return (int(c[0]), int(c[1])) if c else (0, 1)


def split_layers(fine: Graph) -> Graph:
    """`fine` with every unidirectional recurrent node of L > 1 layers split into L one-layer nodes
    '<node>[<l>]' (module '<module>[<l>]', the MP runtime's per-layer placement key), each with its
    layer's weights and FLOPs, so that the placer can put the layers of one nn.LSTM on different
    devices as the runtime runs them with time chunks. Unchanged when there is none (cached by `fine`)."""
    hit = _SPLIT.get(id(fine))
    if hit is not None and hit[0] is fine:
        return hit[1]
    nodes: list[Node] = []
    last: dict[str, str] = {}
    for n in fine.nodes:
        inputs = tuple(last.get(i, i) for i in n.inputs)
        if not (_splittable_lstm(n) and int(n.attr("layers") or 1) > 1):
            nodes.append(dataclasses.replace(n, inputs=inputs) if inputs != n.inputs else n)
            continue
        layers = layer_nodes(n, inputs)
        nodes += layers
        last[n.name] = layers[-1].name
    out = Graph(fine.name, tuple(nodes), batch=fine.batch, meta=fine.meta) if last else fine
    _SPLIT[id(fine)] = (fine, out)
    return out


_SPLIT: dict[int, tuple[Graph, Graph]] = {}


