"""A stacked recurrent node (nn.LSTM/GRU/RNN with num_layers L) as its L one-layer nodes: how the MP
runtime places and chunks its layers (search/placer/unroll.py) and how a measured one-layer time prices
the stack (cost/compute.py: the profile times one layer at a time)."""

from __future__ import annotations

import dataclasses

from hybridpar.graph.flops import lstm_flops
from hybridpar.graph.types import Node


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
