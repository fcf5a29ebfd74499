"""A stacked recurrent node (nn.LSTM/GRU/RNN with num_layers L) as its L one-layer nodes: how the MP
runtime places and chunks its layers (search/placer/unroll.py) and how a measured one-layer time prices
the stack (cost/compute.py: the profile times one layer at a time)."""

from __future__ import annotations

import dataclasses

from hybridpar.graph.flops import lstm_flops
from hybridpar.graph.types import Node

# The K time chunks per recurrent layer the placer weighs against whole layers when none is given
# (search.placer.api._choose_time_chunks); `hybridpar profile --model` times a layer at its chunks' steps
DEFAULT_TIME_CHUNKS = 4


def layer_nodes(n: Node, inputs: tuple[str, ...] | None = None) -> list[Node]:
    """The L one-layer nodes '<node>[<l>]' of a recurrent node of L stacked layers (module
    '<module>[<l>]'), each with its layer's input shape, weights and FLOPs; the first reads `inputs`
    (default the node's), each next one the layer before."""
    inputs = n.inputs if inputs is None else inputs
    a = dict(n.attrs)
    layers, hidden, proj, gates = int(a["layers"]), int(a["hidden"]), int(a.get("proj") or 0), int(a.get("gates", 4))
    x = n.in_shapes[0] if n.in_shapes else n.out_shape
    batch, steps = (x[0], x[1]) if a.get("batch_first") else (x[1], x[0]) if len(x) >= 3 else (1, x[0])
    full = lstm_flops(batch=batch, steps=steps, input_size=a["input_size"], hidden=hidden, proj=proj, layers=layers,
                      gates=gates)
    input_grad = n.bwd_data_flops >= full.bwd_data  # the first layer's input gradient was counted
    out: list[Node] = []
    for layer in range(layers):
        in_l = int(a["input_size"]) if layer == 0 else proj or hidden
        f = lstm_flops(batch=batch, steps=steps, input_size=in_l, hidden=hidden, proj=proj, gates=gates,
                       input_grad=layer > 0 or input_grad)
        attrs = {**a, "layers": 1, "input_size": in_l, "layer": layer}
        if a.get("scope"):  # its own scope: not tied to its siblings as one runtime leaf (tie_shared_modules)
            attrs["scope"] = f"{a['scope']}[{layer}]"
        params = tuple((p, s) for p, s in n.param_shapes if p.endswith(f"_l{layer}"))
        in_shapes = n.in_shapes if layer == 0 else (n.out_shape,) + n.in_shapes[1:]
        out.append(dataclasses.replace(
            n, name=f"{n.name}[{layer}]", inputs=inputs if layer == 0 else (out[-1].name,), in_shapes=in_shapes,
            module=f"{n.module}[{layer}]" if n.module else None, param_shapes=params, fwd_flops=f.fwd,
            bwd_data_flops=f.bwd_data, bwd_weight_flops=f.bwd_weight, attrs=tuple(attrs.items())))
    return out


def record_op(n: Node) -> str:
    """The op name a node's time is recorded under in a calibration file: its op kind, except for a
    recurrent node other than one unidirectional LSTM layer ('gru', 'lstm*4', 'gru*2-bi'): the profile
    times nn.LSTM one layer at a time under 'lstm' and any other recurrent module whole, and a key of
    shapes alone would file a GRU, or a 4-layer stack, as one LSTM layer of the same shapes."""
    if n.op != "lstm":
        return n.op
    a = dict(n.attrs)
    layers = int(a.get("layers") or 1)
    stack = f"*{layers}" if layers > 1 else ""
    return str(a.get("cell") or "lstm") + stack + ("-bi" if a.get("bidirectional") else "")


def chunk_steps(steps: int, t: int, k: int) -> int:
    """The time steps of chunk t of k over `steps`: torch.tensor_split's sizes, as the MP runtime splits a
    sequence (parallel/pipeline/wavefront.py): the first steps % k chunks one step longer."""
    return steps // k + (1 if t < steps % k else 0)


def time_slice(n: Node, steps: int, axis: int) -> Node:
    """`n` run over `steps` of its sequence: every shape of it (output and inputs) that spans the sequence
    along the time `axis` cut to `steps` there, its FLOPs in proportion (exact for a recurrent layer and
    the per-step ops the wavefront runs chunk by chunk). The op a time chunk runs, so that its time is
    looked up at the chunk's own shape."""
    whole = n.out_shape[axis]
    if whole == steps:
        return n

    def cut(shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(shape) <= axis or shape[axis] != whole:
            return shape
        return shape[:axis] + (steps,) + shape[axis + 1:]

    def part(flops: int) -> int:
        return int(flops * steps / whole)

    return dataclasses.replace(n, out_shape=cut(n.out_shape), in_shapes=tuple(cut(s) for s in n.in_shapes),
                               fwd_flops=part(n.fwd_flops), bwd_data_flops=part(n.bwd_data_flops),
                               bwd_weight_flops=part(n.bwd_weight_flops))
