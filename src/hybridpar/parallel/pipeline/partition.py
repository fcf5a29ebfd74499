"""Split a module's torch.fx graph over the M devices of a model-parallel group.

Every rank traces the same module and derives the same partition, so the list of crossings
(activation transfers) and their order are identical everywhere without any communication.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from torch import fx, nn

from hybridpar.errors import UserError
from hybridpar.parallel.pipeline import wavefront


@dataclass(frozen=True)
class Transfer:
    """One activation crossing: the value of fx node `node` goes from device `src` to `dst`.

    `send_pos`/`recv_pos` are topological positions (indices into the fx node list) at which the
    sender sends and the receiver receives; send_pos <= recv_pos always. `index` is the transfer's
    rank in the global order (it doubles as the message tag)."""

    index: int
    node: str
    src: int
    dst: int
    send_pos: int
    recv_pos: int


@dataclass(frozen=True)
class Partition:
    """The traced module, every fx node's device (None: available everywhere, i.e. the inputs),
    the crossings in global order, the device that computes the loss, and the owner device of
    every state_dict entry."""

    gm: fx.GraphModule
    mp: int
    device_of: Mapping[str, int | None]
    transfers: tuple[Transfer, ...]
    output_node: str
    output_device: int
    owner_of_key: Mapping[str, int]
    output_nodes: tuple[str, ...] = ()  # every fx node the model's output holds (tuple/dict outputs), in order

    @cached_property
    def nodes(self) -> tuple[fx.Node, ...]:
        return tuple(self.gm.graph.nodes)

    @cached_property
    def _drops(self) -> dict[int, dict[int, tuple[fx.Node, ...]]]:
        return {d: self._plan_drops(d) for d in range(self.mp)}

    def drops_of(self, device: int) -> dict[int, tuple[fx.Node, ...]]:
        """Position -> the values this device forgets once that position's node and p2p events are
        done: their last local use or send. Why: eager PyTorch frees an activation as soon as nothing
        refers to it, so the allocator hands its memory, still in cache, to the next op; an
        interpreter that keeps every value until the step ends makes every op write cold memory
        and holds every activation (those autograd saves for backward stay held by autograd)."""
        return self._drops[device]

    def _plan_drops(self, device: int) -> dict[int, tuple[fx.Node, ...]]:
        last: dict[fx.Node, int] = {}
        for i, n in enumerate(self.nodes):
            if n.op in ("placeholder", "output") or self.device_of.get(n.name) != device:
                continue
            last.setdefault(n, i)  # a value no one here uses is forgotten where it was made
            for a in n.all_input_nodes:
                last[a] = max(last.get(a, -1), i)
        by_name = {n.name: n for n in self.nodes}
        for t in self.transfers:
            node = by_name[t.node]
            if t.src == device:
                last[node] = max(last.get(node, -1), t.send_pos)
            elif t.dst == device:
                last.setdefault(node, t.recv_pos)
        keep = {by_name[self.output_node], *(by_name[n] for n in self.output_nodes)}
        plan: dict[int, list[fx.Node]] = {}
        for n, i in last.items():
            if n not in keep and n.op != "placeholder":  # inputs: the caller holds them anyway
                plan.setdefault(i, []).append(n)
        return {i: tuple(v) for i, v in plan.items()}

    def events_of(self, device: int) -> list[tuple[int, str, Transfer]]:
        """This device's p2p events in execution order: (position, "send"|"recv", transfer).
        At one position receives come before the local node runs and sends after it."""
        events = []
        for t in self.transfers:
            if t.src == device:
                events.append((t.send_pos, 1, "send", t))
            elif t.dst == device:
                # recv at recv_pos: before the consumer runs (0) or, when recv_pos == send_pos
                # (ordered mode), after the producer ran on the other device (2).
                events.append((t.recv_pos, 2 if t.recv_pos == t.send_pos else 0, "recv", t))
        events.sort(key=lambda e: (e[0], e[1], e[3].index))
        return [(pos, kind, t) for pos, _, kind, t in events]

    def nodes_on(self, device: int) -> list[str]:
        return [n for n, d in self.device_of.items() if d == device]


def trace(module: nn.Module, example_inputs: tuple | None = None) -> fx.GraphModule:
    """torch.fx's graph, else (given example inputs at the batch the graph will run) torch.export's
    (hybridpar.graph.runnable)."""
    from hybridpar.graph.runnable import runnable_graph

    return runnable_graph(module, example_inputs)


def _lookup(placement: Mapping[str, int], module_name: str | None) -> int | None:
    """Placement of a module, or of its nearest placed ancestor ("a.b.c" -> "a.b" -> "a")."""
    while module_name:
        if module_name in placement:
            return placement[module_name]
        module_name = module_name.rpartition(".")[0]
    return None


def _enclosing_modules(node: fx.Node) -> list[str]:
    """Qualified names of the modules whose forward created this node, innermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _ in reversed(list(stack.values()))]


def assign_devices(gm: fx.GraphModule, placement: Mapping[str, int]) -> dict[str, int | None]:
    """fx node -> device. Explicit entries win (fx node name, then module name or an ancestor's);
    functional nodes follow their enclosing placed module, else their first input's device."""
    device: dict[str, int | None] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            device[node.name] = None
            continue
        if node.op == "output":
            continue
        dev = placement.get(node.name)
        if dev is None and node.op in ("call_module", "get_attr"):
            dev = _lookup(placement, str(node.target))
        if dev is None:
            for mod in _enclosing_modules(node):
                dev = _lookup(placement, mod)
                if dev is not None:
                    break
        if dev is None:
            dev = next((device[a.name] for a in node.all_input_nodes if device.get(a.name) is not None), None)
        device[node.name] = 0 if dev is None else dev
    return device


def _state_owners(module: nn.Module, gm: fx.GraphModule, device: Mapping[str, int | None]) -> dict[str, int]:
    """Owner device of every state_dict key; a parameter needed on two devices is an error."""
    owner_by_id: dict[int, tuple[int, str]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            tensors = [*sub.named_parameters(str(node.target)), *sub.named_buffers(str(node.target))]
        elif node.op == "get_attr":
            obj = _get_attr(gm, str(node.target))
            if isinstance(obj, nn.Module):
                tensors = [*obj.named_parameters(str(node.target)), *obj.named_buffers(str(node.target))]
            else:
                tensors = [(str(node.target), obj)]
        else:
            continue
        dev = device[node.name]
        assert dev is not None  # place_nodes gives every node a device
        for name, t in tensors:
            prev = owner_by_id.setdefault(id(t), (dev, node.name))
            if prev[0] != dev:
                raise UserError(f"placement puts {name} on devices {prev[0]} ({prev[1]}) and {dev} "
                                f"({node.name}); a module with weights must sit on one device")
    owners: dict[str, int] = {}
    state = module.state_dict(keep_vars=True)
    for key, t in state.items():
        owners[key] = owner_by_id.get(id(t), (0, ""))[0]  # unused state stays with device 0
    return owners


def _get_attr(root: nn.Module, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _transfers(gm: fx.GraphModule, device: Mapping[str, int | None], lazy_recv: bool) -> list[Transfer]:
    pos = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    out: list[Transfer] = []
    for node in gm.graph.nodes:
        src = device.get(node.name)
        if src is None or node.op == "output":
            continue
        first_use: dict[int, int] = {}
        for user in node.users:
            dst = device.get(user.name)
            if user.op == "output" or dst is None or dst == src:
                continue
            first_use[dst] = min(first_use.get(dst, pos[user.name]), pos[user.name])
        for dst in sorted(first_use):
            recv_pos = first_use[dst] if lazy_recv else pos[node.name]
            out.append(Transfer(0, node.name, src, dst, pos[node.name], recv_pos))
    # global order: by send position (the producer's), then destination
    out.sort(key=lambda t: (t.send_pos, t.dst))
    return [Transfer(i, t.node, t.src, t.dst, t.send_pos, t.recv_pos) for i, t in enumerate(out)]


def _output_node(gm: fx.GraphModule) -> fx.Node:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    value = out.args[0]
    while isinstance(value, (tuple, list)) and value:
        value = value[0]  # a model returning (logits, aux, ...) is trained on the first output
    if isinstance(value, dict) and value:
        value = next(iter(value.values()))
    if not isinstance(value, fx.Node):
        raise UserError("model parallelism: the model's output is not a tensor computed by the model")
    return value


def output_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Every fx node the graph's output holds (a tensor, or tuples/lists/dicts of them), in order."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    found: list[fx.Node] = []
    fx.node.map_arg(out.args[0], lambda n: found.append(n) if n not in found else None)
    return found


def partition_module(module: nn.Module, placement: Mapping[str, int] | None, mp: int, *,
                     lazy_recv: bool = True, example_inputs: tuple | None = None,
                     time_chunks: int = 1) -> Partition:
    """Trace `module` and split it over `mp` devices following `placement`. `example_inputs`, at the
    batch each forward will take, let a model torch.fx cannot trace run on torch.export's graph.
    `time_chunks` K >= 2 runs recurrent layers as the time-step wavefront (pipeline.wavefront), each
    layer of a stacked module where its '<module>[<layer>]' key places it.

    lazy_recv: receive each activation just before its first local use (more overlap; needs
    non-blocking sends, as gloo's). False receives it at the producer's position, so that every
    pair of ranks issues its p2p operations in one global order (what NCCL needs)."""
    if mp < 1:
        raise UserError(f"mp must be >= 1, got {mp}")
    placement = dict(placement or {})
    bad = {k: v for k, v in placement.items() if not (isinstance(v, int) and 0 <= v < mp)}
    if bad:
        k, v = next(iter(bad.items()))
        raise UserError(f"placement[{k!r}] = {v!r} outside devices 0..{mp - 1}")
    gm = trace(module, example_inputs)
    wavefront.check_layer_keys(module, placement, time_chunks)
    known = ({n.name for n in gm.graph.nodes} | {name for name, _ in module.named_modules()}
             | wavefront.layer_keys(module))
    unknown = sorted(k for k in placement if k not in known)
    if unknown:
        raise UserError(f"placement names {unknown[0]!r}, which is neither a module nor an fx node of "
                        f"the model ({len(unknown)} unknown name(s))")
    device = assign_devices(gm, placement)
    gm, device = wavefront.rewrite(gm, device, placement, time_chunks, assign_devices)
    out_node = _output_node(gm)
    return Partition(gm=gm, mp=mp, device_of=device, transfers=tuple(_transfers(gm, device, lazy_recv)),
                     output_node=out_node.name, output_device=device[out_node.name] or 0,
                     owner_of_key=_state_owners(module, gm, device),
                     output_nodes=tuple(n.name for n in output_nodes(gm)))
