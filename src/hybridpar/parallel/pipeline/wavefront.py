"""The recurrent time-step wavefront: recurrent layers split into K time chunks (`time_chunks`).

`rewrite(gm, device, placement, K)` turns the partition's fx graph into one where every unidirectional
nn.LSTM / nn.GRU / nn.RNN module call runs layer by layer and chunk by chunk:

- a stacked module (num_layers=L) becomes L layers, each reading its own weights (get_attr nodes on
  the user's `weight_ih_l{l}`, ... parameters, so gradients land in the user's parameters); layer l
  runs on the device placed for `"<module>[<l>]"`, else on the module's;
- each layer runs its input's K time chunks in order, carrying its state (h, or (h, c)) from chunk t
  to chunk t+1 on its device; its output chunks go on to the next layer, crossing devices one chunk
  at a time (the pipeline's p2p transfers), so layer l on device 0 runs chunk t+1 while layer l+1 on
  device 1 runs chunk t. Backward runs the same graph in reverse (autograd, each rank's p2p token
  chain): the state gradients flow back chunk to chunk, the chunk gradients device to device;
- time-wise ops fed by chunks (dropout, linear, activations, layer norm over the last axis, elementwise
  arithmetic, a concat over the last axis) run per chunk too, so a chain of layers with residual adds
  and dropouts between them keeps its wavefront; any other consumer gets the chunks concatenated.
  Another input of such an op that spans the whole sequence is sliced to the chunk at run time
  (`time_piece`: broadcast inputs, weights and scalars are used whole), which keeps it exact.

Chunks are torch.tensor_split's (sizes differ by at most one step). Exact with one process: the same
per-step arithmetic in the same order. Bidirectional modules run whole (their backward direction needs
the whole sequence); a packed sequence is refused; a stacked module with dropout between its layers
is refused (its training flag would be frozen into the graph). Graphs from torch.export hold no module
calls and run whole.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import _VF, fx, nn

from hybridpar.errors import UserError

# modules whose output step t depends on their input's step t alone (ops over the last axis)
_TIMEWISE_MODULES = (nn.Dropout, nn.Linear, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.Identity)
_ELEMENTWISE = frozenset({operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub,
                          torch.mul, torch.tanh, torch.sigmoid, torch.relu, F.relu, F.dropout, F.gelu})
_CAT = frozenset({torch.cat, torch.concat})
_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


# -- run-time ops (the rewritten graph's call_function targets) ---------------------------------------
def time_dim(x: torch.Tensor, batch_first: bool) -> int:
    """The time axis of a recurrent layer's input or output (unbatched: a 2-D (T, features))."""
    return 1 if batch_first and x.dim() == 3 else 0


def split_time(x, chunks: int, batch_first: bool) -> tuple[torch.Tensor, ...]:
    if not isinstance(x, torch.Tensor):
        raise UserError(f"time chunks: a recurrent layer got a {type(x).__name__}, not a tensor (packed sequences "
                        "are not split); use --time-chunks 1")
    return torch.tensor_split(x, chunks, dim=time_dim(x, batch_first))


def cat_time(batch_first: bool, *chunks: torch.Tensor) -> torch.Tensor:
    return torch.cat(chunks, dim=time_dim(chunks[0], batch_first))


def time_piece(y, ref: torch.Tensor, t: int, chunks: int, batch_first: bool):
    """Chunk t of `y`, an input of a time-wise op whose other input `ref` is chunk t of a sequence:
    y sliced along the axis broadcasting aligns with ref's time axis, unless y is not a tensor or is
    broadcast along it (size 1, or too few dims)."""
    if not isinstance(y, torch.Tensor):
        return y
    idx = y.dim() - (ref.dim() - time_dim(ref, batch_first))
    if idx < 0 or y.shape[idx] == 1:
        return y
    return torch.tensor_split(y, chunks, dim=idx)[t]


def layer_state(hx, layer: int, mode: str):
    """Layer `layer`'s slice of the user's initial state (None: zeros, as nn.LSTM makes them)."""
    if hx is None:
        return None
    if mode == "LSTM":
        return hx[0][layer:layer + 1], hx[1][layer:layer + 1]
    return hx[layer:layer + 1]


def final_state(mode: str, *states):
    """The module's (h_n, c_n) / h_n: every layer's state after its last chunk, stacked as nn.LSTM's."""
    if mode == "LSTM":
        return torch.cat([s[0] for s in states]), torch.cat([s[1] for s in states])
    return torch.cat(states)


def rnn_chunk(x: torch.Tensor, hx, mode: str, batch_first: bool, has_biases: bool, *weights: torch.Tensor):
    """One layer of nn.LSTM/GRU/RNN (unidirectional) over one time chunk from state `hx` (the user's
    layout: (1, B, H), unbatched (1, H); None: zeros): (output chunk, state after it)."""
    width = weights[1].shape[1]  # weight_hh: (gates * hidden, hidden or proj)
    tdim = time_dim(x, batch_first)
    if x.shape[tdim] == 0 and hx is not None:  # more chunks than steps: nothing to run
        return x.new_empty((*x.shape[:-1], width)), hx
    unbatched = x.dim() == 2
    bdim = 0 if batch_first else 1
    if unbatched:
        x = x.unsqueeze(bdim)
        hx = None if hx is None else tuple(s.unsqueeze(1) for s in hx) if mode == "LSTM" else hx.unsqueeze(1)
    if hx is None:
        h0 = x.new_zeros((1, x.shape[bdim], width))
        hx = (h0, x.new_zeros((1, x.shape[bdim], weights[1].shape[0] // 4))) if mode == "LSTM" else h0
    fn: Any = {"LSTM": _VF.lstm, "GRU": _VF.gru, "RNN_TANH": _VF.rnn_tanh, "RNN_RELU": _VF.rnn_relu}[mode]
    # dropout 0 between layers (refused otherwise), so `train` changes nothing: True keeps cuDNN's backward
    out, *state = fn(x, hx, list(weights), has_biases, 1, 0.0, True, False, batch_first)
    if unbatched:
        out, state = out.squeeze(bdim), [s.squeeze(1) for s in state]
    return out, (tuple(state) if mode == "LSTM" else state[0])


# -- the rewrite -----------------------------------------------------------------------------------
@dataclass
class _Chunks:
    nodes: list[fx.Node]  # the new graph's chunk values, in time order
    batch_first: bool
    device: int | None


def splittable(mod: nn.Module) -> bool:
    return isinstance(mod, nn.RNNBase) and not mod.bidirectional and mod.mode in _GATES


def layer_keys(module: nn.Module) -> set[str]:
    """The placement keys of single layers: '<module>[<l>]' for every recurrent module it can split."""
    return {f"{name}[{layer}]" for name, mod in module.named_modules() if splittable(mod)
            for layer in range(mod.num_layers)}


def check_layer_keys(module: nn.Module, placement: Mapping[str, int], chunks: int) -> None:
    """UserError for a per-layer placement key the runtime will not honour."""
    bad = sorted(k for k in placement if k.endswith("]") and "[" in k)
    if not bad:
        return
    known = layer_keys(module)
    for key in bad:
        if key not in known:
            raise UserError(f"placement names {key!r}: per-layer keys '<module>[<layer>]' name a layer of a "
                            "unidirectional nn.LSTM/GRU/RNN (a bidirectional one runs whole on one device)")
        if chunks < 2:
            raise UserError(f"placement names layer {key!r}: recurrent layers run split per layer only with "
                            "time chunks (--time-chunks K >= 2); place the module whole, or give K")


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, device: Mapping[str, int | None], placement: Mapping[str, int],
                 chunks: int, module_device: Mapping[str, int | None]):
        self.gm, self.old_device, self.placement, self.k = gm, device, placement, chunks
        self.module_device = module_device  # a recurrent module's device, for its layers without a key
        self.g = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.chunked: dict[fx.Node, _Chunks] = {}
        self.cats: dict[tuple[fx.Node, int | None], fx.Node] = {}
        self.device: dict[str, int | None] = {}
        self.skip: set[fx.Node] = set()

    def emit(self, op: str, target, args: tuple, name: str, dev: int | None, meta: dict, kwargs=None) -> fx.Node:
        n = self.g.create_node(op, target, args, kwargs or {}, name=name)
        n.meta = dict(meta)
        self.device[n.name] = dev
        return n

    def whole(self, old: fx.Node, dev: int | None) -> fx.Node:
        """The new graph's value of `old`, its chunks concatenated (on `dev`) when it was split."""
        if old not in self.chunked:
            return self.env[old]
        ch = self.chunked[old]
        dev = ch.device if dev is None else dev
        key = (old, dev)
        if key not in self.cats:
            self.cats[key] = self.emit("call_function", cat_time, (ch.batch_first, *ch.nodes), f"{old.name}_whole",
                                       dev, old.meta)
        return self.cats[key]

    def run(self) -> tuple[fx.GraphModule, dict[str, int | None]]:
        for node in self.gm.graph.nodes:
            if node in self.skip:
                continue
            if node.op == "call_module" and self._rnn(node):
                continue
            if self._timewise(node):
                continue
            dev = self.old_device.get(node.name)
            new = self.g.node_copy(node, functools.partial(self.whole, dev=dev))
            self.env[node] = new
            self.device[new.name] = dev
        out = fx.GraphModule(self.gm, self.g)
        for attr in ("_out_spec", "_in_spec"):
            if hasattr(self.gm, attr):
                setattr(out, attr, getattr(self.gm, attr))
        return out, self.device

    # a recurrent module call -> per-layer, per-chunk calls
    def _rnn(self, node: fx.Node) -> bool:
        mod = self.gm.get_submodule(str(node.target))
        if not isinstance(mod, nn.RNNBase) or not splittable(mod):
            return False
        name, mode, bf = str(node.target), mod.mode, mod.batch_first
        users = list(node.users)
        if not users or not all(u.op == "call_function" and u.target is operator.getitem and u.args[1] in (0, 1)
                                for u in users):
            if any(f"{name}[{layer}]" in self.placement for layer in range(mod.num_layers)):
                raise UserError(f"placement names layers of {name}, whose result the model uses whole (not as "
                                f"`out, state = {name}(...)`): place the module whole")
            return False
        if mod.num_layers > 1 and mod.dropout > 0:
            raise UserError(f"time chunks: {name} is a stacked {type(mod).__name__} with dropout={mod.dropout} "
                            "between its layers; use --time-chunks 1, or separate modules with nn.Dropout between")
        x = node.args[0]
        hx = node.args[1] if len(node.args) > 1 else node.kwargs.get("hx")
        own = self.module_device[node.name]
        devs = [self.placement.get(f"{name}[{layer}]", own) for layer in range(mod.num_layers)]
        ins = self._input_chunks(x, bf, devs[0], node)
        # hx may be a literal (h, c) tuple of nodes: every node in it mapped into the new graph
        hx_new = fx.node.map_arg(hx, lambda n: self.whole(n, devs[0]))
        last = []
        for layer, dev in enumerate(devs):
            weights = [self.emit("get_attr", f"{name}.{w}", (), f"{node.name}_{w}", dev, node.meta)
                       for w in mod._flat_weights_names if w.endswith(f"_l{layer}")]
            state = None if hx_new is None else self.emit(
                "call_function", layer_state, (hx_new, layer, mode), f"{node.name}_h0_l{layer}", dev, node.meta)
            outs = []
            for t, x_t in enumerate(ins):
                step = self.emit("call_function", rnn_chunk, (x_t, state, mode, bf, mod.bias, *weights),
                                 f"{node.name}_l{layer}_t{t}", dev, node.meta)
                outs.append(self.emit("call_function", operator.getitem, (step, 0), f"{step.name}_out", dev, node.meta))
                state = self.emit("call_function", operator.getitem, (step, 1), f"{step.name}_state", dev, node.meta)
            ins = outs
            last.append(state)
        for u in users:
            self.skip.add(u)
            if u.args[1] == 0:
                self.chunked[u] = _Chunks(ins, bf, devs[-1])
            elif u.users:  # (an unused final state is not gathered from the layers' devices)
                self.env[u] = self.emit("call_function", final_state, (mode, *last), u.name, devs[-1], u.meta)
        return True

    def _input_chunks(self, x, bf: bool, dev: int | None, node: fx.Node) -> list[fx.Node]:
        if isinstance(x, fx.Node) and x in self.chunked and self.chunked[x].batch_first == bf:
            return list(self.chunked[x].nodes)
        src = self.whole(x, dev) if isinstance(x, fx.Node) else x
        split = self.emit("call_function", split_time, (src, self.k, bf), f"{node.name}_split", dev, node.meta)
        return [self.emit("call_function", operator.getitem, (split, t), f"{split.name}_{t}", dev, node.meta)
                for t in range(self.k)]

    # a time-wise op fed by chunks -> one call per chunk
    def _timewise(self, node: fx.Node) -> bool:
        feeds = [a for a in node.all_input_nodes if a in self.chunked]
        if not feeds or len({self.chunked[a].batch_first for a in feeds}) > 1 or not self._is_timewise(node):
            return False
        ref = self.chunked[feeds[0]]
        dev = self.old_device.get(node.name)
        nodes = []
        for t in range(self.k):
            def arg(a, t=t):
                if a in self.chunked:
                    return self.chunked[a].nodes[t]
                return self.emit("call_function", time_piece, (self.env[a], ref.nodes[t], t, self.k, ref.batch_first),
                                 f"{a.name}_piece{t}", dev, a.meta)
            nodes.append(self.emit(node.op, node.target, fx.node.map_arg(node.args, arg), f"{node.name}_t{t}", dev,
                                   node.meta, kwargs=fx.node.map_arg(node.kwargs, arg)))
        self.chunked[node] = _Chunks(nodes, ref.batch_first, dev)
        return True

    def _is_timewise(self, node: fx.Node) -> bool:
        if node.op == "call_module":
            mod = self.gm.get_submodule(str(node.target))
            return isinstance(mod, _TIMEWISE_MODULES) or (isinstance(mod, nn.LayerNorm)
                                                          and len(mod.normalized_shape) == 1)
        if node.op != "call_function":
            return False
        if node.target in _ELEMENTWISE:
            return True
        if node.target in _CAT:
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            return dim in (-1, 2)  # the feature axis of (B, T, F) / (T, B, F): never the time axis
        return False


def rewrite(gm: fx.GraphModule, device: Mapping[str, int | None], placement: Mapping[str, int],
            chunks: int, assign: Callable[[fx.GraphModule, Mapping[str, int]], dict[str, int | None]]
            ) -> tuple[fx.GraphModule, dict[str, int | None]]:
    """`gm` with its recurrent layers run as the time-chunk wavefront (this module's doc), and the
    device of every node of the new graph. Unchanged (a copy of `device`) for chunks < 2. `device`:
    `assign(gm, placement)` (partition.assign_devices), rerun here with a recurrent module's output on
    its last layer's device, so that what follows it without a placement of its own runs there."""
    if chunks < 2:
        return gm, dict(device)
    outputs: dict[str, int] = {}
    for node in gm.graph.nodes:
        mod = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        if isinstance(mod, nn.RNNBase) and splittable(mod):
            last = placement.get(f"{node.target}[{mod.num_layers - 1}]", device[node.name])
            outputs[node.name] = 0 if last is None else last
    moved = any(d != device[n] for n, d in outputs.items())
    new_gm, new_device = _Rewriter(gm, assign(gm, {**placement, **outputs}) if moved else device, placement,
                                   chunks, device).run()
    new_gm.train(gm.training)
    return new_gm, new_device
