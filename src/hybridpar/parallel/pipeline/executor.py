"""Run one rank's share of a partitioned fx graph: its own nodes, plus the sends and receives
of the activations that cross to or from its device."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from hybridpar.graph.runnable import is_exported
from hybridpar.parallel.pipeline.p2p import Link, Recv, Send, new_token
from hybridpar.parallel.pipeline.partition import Partition


@dataclass(frozen=True)
class Crossing:
    """What travels for one transfer: the value's pytree spec, its leaves as seen on the meta
    device (shapes, dtypes, and the non-tensor leaves themselves), which tensor leaves carry a
    gradient, and the message number of its first tensor."""

    spec: object
    leaves: tuple
    diff: tuple[bool, ...]
    first_msg: int

    @property
    def tensor_leaves(self) -> list[torch.Tensor]:
        return [x for x in self.leaves if isinstance(x, torch.Tensor)]


def meta_copy(module: nn.Module) -> nn.Module:
    """The module with every parameter and buffer on the meta device (no storage copied)."""
    memo: dict[int, object] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def meta_values(part: Partition, meta_module: nn.Module, inputs: tuple) -> dict[str, object]:
    """Every fx node's value for inputs shaped like `inputs`, computed on the meta device.
    `meta_module`: meta_copy of the module (of the GraphModule itself for an exported graph, whose
    constants live on it)."""
    gm = fx.GraphModule(meta_module, part.gm.graph)
    gm.train(part.gm.training)
    interp = _LocalInterpreter(gm, torch.device("meta"), exported=is_exported(part.gm))
    with torch.enable_grad():  # which values carry a gradient (Crossing.diff), whatever the caller's mode
        interp.run(*[x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs])
    return {n.name: v for n, v in interp.env.items()}


def crossings(part: Partition, values: dict[str, object]) -> dict[int, Crossing]:
    out: dict[int, Crossing] = {}
    msg = 0
    for t in part.transfers:
        leaves, spec = tree_flatten(values[t.node])
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        diff = tuple(x.requires_grad and (x.is_floating_point() or x.is_complex()) for x in tensors)
        out[t.index] = Crossing(spec, tuple(leaves), diff, msg)
        msg += len(tensors)
    return out


def message_count(cross: dict[int, Crossing]) -> int:
    return sum(len(c.tensor_leaves) for c in cross.values())


class _LocalInterpreter(fx.Interpreter):
    """fx.Interpreter whose environment we fill ourselves (received values, inputs). On a graph from
    torch.export (hybridpar.graph.runnable) the devices the export saw are this rank's: a `device=`
    argument (arange, zeros, ...) and the constants it lifted are put on `device`."""

    def __init__(self, gm: fx.GraphModule, device: torch.device | None = None, *, exported: bool = False):
        super().__init__(gm, garbage_collect_values=False)
        self.device, self.exported = device, exported

    def call_function(self, target, args, kwargs):
        if self.exported and self.device is not None:  # `aten.to.device(x, cpu, ...)` too: positional
            args = tuple(self.device if isinstance(a, torch.device) else a for a in args)
            if kwargs.get("device") is not None:
                kwargs = {**kwargs, "device": self.device}
        return super().call_function(target, args, kwargs)

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        if (self.exported and self.device is not None and isinstance(value, torch.Tensor)
                and not isinstance(value, nn.Parameter) and value.device != self.device):
            value = value.to(self.device)  # a lifted constant (a parameter is where its owner put it)
        return value


def run_forward(part: Partition, device: int, link: Link, inputs: tuple, cross: dict[int, Crossing],
                msg_base: int, torch_device: torch.device, *, all_outputs: bool = False
                ) -> tuple[object | None, torch.Tensor]:
    """Forward of one (micro-)batch on this device. Returns (the model output if this device
    computes it else None, the last token of this rank's p2p chain); with `all_outputs`, the first is
    {fx node name: value} of every node of the model's output this device holds (its own, and the
    inputs: a placeholder is everywhere). Without autograd recording (torch.no_grad), no gradient
    transfer is prepared: none will come."""
    if not torch.is_grad_enabled():
        cross = {i: replace(c, diff=(False,) * len(c.diff)) for i, c in cross.items()}
    interp = _LocalInterpreter(part.gm, torch_device, exported=is_exported(part.gm))
    env = interp.env
    nodes = part.nodes
    token = new_token(torch_device)
    events = part.events_of(device)
    drops = part.drops_of(device)
    tag = {i: msg_base + c.first_msg for i, c in cross.items()}
    incoming = {}
    if link.prepost:  # post every receive now; each is waited where it is needed
        incoming = {t.index: _post(link, t.src, cross[t.index], tag[t.index], torch_device)
                    for _, kind, t in events if kind == "recv"}
    args = iter(inputs)
    ev = iter(events)
    nxt = next(ev, None)
    for i, node in enumerate(nodes):
        while nxt is not None and nxt[0] == i and nxt[1] == "recv" and nxt[2].recv_pos != nxt[2].send_pos:
            token = _recv(link, nxt[2], cross, tag, incoming, token, env, nodes, torch_device)
            nxt = next(ev, None)
        if node.op == "placeholder":
            x = next(args)
            env[node] = x.to(torch_device) if isinstance(x, torch.Tensor) else x
        elif node.op != "output" and part.device_of[node.name] == device:
            env[node] = interp.run_node(node)
        while nxt is not None and nxt[0] == i:
            _, kind, t = nxt
            if kind == "send":
                leaves, _ = tree_flatten(env[node])
                tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
                token = Send.apply(link, t.dst, tag[t.index], cross[t.index].diff, token, *tensors)
            else:
                token = _recv(link, t, cross, tag, incoming, token, env, nodes, torch_device)
            nxt = next(ev, None)
        for gone in drops.get(i, ()):  # as eager frees it (Partition.drops_of)
            env.pop(gone, None)
    if all_outputs:
        wanted = set(part.output_nodes)
        return {n.name: env[n] for n in nodes if n.name in wanted and n in env
                and part.device_of.get(n.name) in (device, None)}, token
    out_node = next(n for n in nodes if n.name == part.output_node)
    output = env[out_node] if part.output_device == device else None
    return output, token


def _post(link: Link, src: int, c: Crossing, tag: int, torch_device: torch.device) -> list:
    return [link.irecv(torch.empty(x.shape, dtype=x.dtype, device=torch_device), src, 2 * (tag + j), "fwd")
            for j, x in enumerate(c.tensor_leaves)]


def _recv(link: Link, t, cross, tag, incoming, token, env, nodes, torch_device):
    c = cross[t.index]
    inc = incoming.pop(t.index, None) or _post(link, t.src, c, tag[t.index], torch_device)
    token, *tensors = Recv.apply(link, t.src, tag[t.index], c.diff, inc, token)
    it = iter(tensors)
    leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in c.leaves]
    producer = nodes[t.send_pos]
    env[producer] = tree_unflatten(leaves, c.spec)
    return token

