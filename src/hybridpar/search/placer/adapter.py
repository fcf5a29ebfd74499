"""Build a PlacementProblem from a model Graph and a Cluster (hybridpar.cost supplies every figure).

Per coarse node: forward and backward times are the sums of its fine members' op_time (roofline or
profiled; a time chunk's members at the chunk's own shape: cost.compute.chunk_time) plus the optimizer
update; memory is what training_memory counts for its members (weights, gradients, optimizer state, kept
activations); the bytes sent to a consumer on another device are the
outputs of members that leave the node. Transfers use the cluster's routes (link ids, bandwidth,
latency) between the MP group's devices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hybridpar.cluster import Cluster
from hybridpar.cluster.calibration import load_calibration
from hybridpar.cost import memory as cost_memory
from hybridpar.cost.collectives import allreduce_time
from hybridpar.cost.compute import OpTime, chunk_time, op_time
from hybridpar.cost.memory import kept_activations, optimizer_state_copies
from hybridpar.cost.update import step_work
from hybridpar.graph.coarsen import merge_groups
from hybridpar.graph.params import owner_of
from hybridpar.graph.types import DTYPE_BYTES, Graph, Node
from hybridpar.search.placer.problem import PlacementProblem, Task
from hybridpar.search.placer.unroll import chunk_of, share, tie_name, time_axis

LOSS_BYTES = 4  # the MP runtime allreduces the step's fp32 loss over the group


def members(node: Node) -> tuple[str, ...]:
    return tuple(node.attr("members") or (node.name,))


def node_modules(node: Node) -> tuple[str, ...]:
    mods = node.attr("modules")
    return tuple(mods) if mods is not None else ((node.module,) if node.module else ())


RUNTIME_LEAVES = "runtime_leaves"  # Graph.meta key: modules with weights the MP runtime runs as one node


def runtime_leaves(module) -> tuple[str, ...]:
    """Qualified names of the submodules with parameters that the MP runtime calls as one node: its
    torch.fx trace keeps torch.nn's own modules whole (fx's default leaf rule: nn.MultiheadAttention,
    nn.TransformerEncoderLayer, nn.LSTM, ...), where the placer's graph sees their ops one by one.
    Outermost only."""
    from torch import fx, nn

    tracer = fx.Tracer()
    containers = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)  # never called
    out: list[str] = []
    for name, mod in module.named_modules():
        if not name or isinstance(mod, containers) or any(name.startswith(f"{leaf}.") for leaf in out):
            continue
        if tracer.is_leaf_module(mod, name) and next(mod.parameters(), None) is not None:
            out.append(name)
    return tuple(out)


def leaf_of(scope: str | None, leaves) -> str | None:
    """The runtime leaf module (runtime_leaves) whose forward made a node of this scope, if any."""
    if not scope:
        return None
    return next((leaf for leaf in leaves if scope == leaf or scope.startswith(f"{leaf}.")), None)


def tie_shared_modules(graph: Graph) -> Graph:
    """Merge the nodes that call one module with weights (e.g. a shared embedding) and every node on a
    path between them: its weights can live on one device only, and the merged set is convex. So are
    the nodes of a module the MP runtime runs whole (Graph.meta RUNTIME_LEAVES: nn.MultiheadAttention's
    in-projection, attention and out-projection), which it cannot split over devices."""
    by_mod: dict[str, list[str]] = {}
    weighted: set[str] = set()
    leaves = dict(graph.meta).get(RUNTIME_LEAVES, ())
    for n in graph.nodes:
        leaf = leaf_of(n.attr("scope"), leaves)
        if leaf is not None:
            by_mod.setdefault(f"leaf:{leaf}", []).append(n.name)
            weighted.add(f"leaf:{leaf}")
        elif n.module:
            by_mod.setdefault(n.module, []).append(n.name)
            if n.params:  # parameters are attributed to a module's first call only
                weighted.add(n.module)
    shared = [names for mod, names in by_mod.items() if len(names) > 1 and mod in weighted]
    if not shared:
        return graph
    succ = graph.successors
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    group_of = {n.name: i for i, n in enumerate(graph.nodes)}
    for names in shared:
        hull = _convex_hull(graph, names, succ, index)
        target = group_of[names[0]]
        olds = {group_of[x] for x in hull}
        for n, g in list(group_of.items()):
            if g in olds:
                group_of[n] = target
    groups: dict[int, list[str]] = {}
    for n in graph.nodes:
        groups.setdefault(group_of[n.name], []).append(n.name)
    return merge_groups(graph, list(groups.values()))


def _convex_hull(graph: Graph, names: Sequence[str], succ, index) -> set[str]:
    """Nodes on some path between two of `names` (names included)."""
    pred = {n.name: n.inputs for n in graph.nodes}

    def reach(starts, nxt) -> set[str]:
        seen, stack = set(starts), list(starts)
        while stack:
            for y in nxt[stack.pop()]:
                if y not in seen:
                    seen.add(y)
                    stack.append(y)
        return seen

    return reach(names, succ) & reach(names, pred)


def task_compute_s(coarse: Graph, fine: Graph, cluster: Cluster, *, dtype: str = "fp32",
                   sample_frac: float = 1.0) -> dict[str, tuple[float, float]]:
    """Each task's (forward, backward) op time at `sample_frac` of the batch: the op part of its Task's
    fwd_s / bwd_s (problem_from_graph; without the executor's per-node cost, the loss and the update).
    placer.micro prices a micro-batch with it, since an op at B/K samples is not 1/K of the op at B
    (weights are read and gradients written once per micro-batch; small shapes run below peak)."""
    out = {}
    axis = time_axis(fine)
    for n in coarse.nodes:
        fwd = bwd = 0.0
        for x in members(n):
            t = member_time(fine.node(x), n, axis, cluster, dtype, sample_frac)
            fwd += t.fwd_s
            bwd += t.bwd_s
        out[n.name] = (fwd, bwd)
    return out


def member_time(fn: Node, n: Node, axis: int | None, cluster: Cluster, dtype: str, sample_frac: float = 1.0) -> OpTime:
    """op_time of `fn`, a fine member of coarse node `n`: at its time chunk's shape when `n` is one
    (unroll: chunk t of K along the time `axis`), whole otherwise."""
    c, k = chunk_of(n)
    if k > 1 and axis is not None:
        return chunk_time(fn, c, k, axis, cluster, dtype=dtype, sample_frac=sample_frac)
    return op_time(fn, cluster, dtype=dtype, sample_frac=sample_frac)


def problem_from_graph(coarse: Graph, fine: Graph, cluster: Cluster, device_ids: Sequence[int], *,
                       dtype: str = "fp32", optimizer: str = "momentum",
                       mem_capacity_bytes: float | None = None, program_order: bool = True) -> PlacementProblem:
    """The placement problem of `coarse` (a coarsening of `fine`) on `device_ids` of `cluster`.
    program_order: priced in the order the MP runtime runs (PlacementProblem.program_order; the coarse
    nodes in the order of their first member, an approximation where coarsening merged nodes that the
    traced program interleaves); False prices any order, a what-if."""
    m = len(device_ids)
    b = DTYPE_BYTES[dtype]
    master = 4 if b < 4 else 0
    # weights (+fp32 master), grads, optimizer state (fp32 buffers)
    per_param = b + master + b + 4 * optimizer_state_copies(optimizer)
    kept = set(kept_activations(fine))
    owner = {x: tie_name(n) for n in coarse.nodes for x in members(n)}
    fine_succ = fine.successors
    dev = cluster.device
    node_s = executor_node_overhead_s(cluster)
    work = step_work(cluster, optimizer, dtype=dtype)
    outputs = set(fine.outputs)
    tasks = []
    axis = time_axis(fine)
    for n in coarse.nodes:
        c, k = chunk_of(n)
        fwd = bwd = ovh = 0.0
        mem = out = grad = 0
        for x in members(n):
            fn = fine.node(x)
            t = member_time(fn, n, axis, cluster, dtype)  # a time chunk's own op time (chunk_time)
            ovh += node_s if fn.op != "input" else 0.0  # per chunk too: each runs its own graph nodes
            fwd += t.fwd_s
            # the optimizer's work on this node's parameters, on its device after backward (the
            # schedule counts it in the node's backward, 1/K of it in each time chunk's); the loss
            # after the output's forward
            bwd += t.bwd_s + work.update_per_tensor(len(fn.param_shapes), fn.params) / k
            if fn.name in outputs:
                fwd += work.loss_s(fn.out_numel) / k
            mem += fn.params * per_param
            grad += fn.params * b
            mem += _activation_bytes(fn, x in kept, b)
            # graph inputs arrive from the data loader on whichever device consumes them
            leaving = [s for s in fine_succ[x] if owner[s] != tie_name(n)]
            if fn.op != "input" and leaving:
                out += max(_read_numel(fine.node(s), x, fn) for s in leaving) * b
        # a time chunk t of K: its own op times (above), 1/K of the node's memory and output; its weight
        # gradients are complete after chunk 0's backward (the last to run), so they are counted there
        fwd += ovh
        tasks.append(Task(n.name, tuple(n.inputs), (fwd,) * m, (bwd,) * m, share(mem, c, k), share(out, c, k),
                          node_modules(n), int(grad) if c == 0 else 0, n.attr("tie") or "", ovh))
    bw = tuple(tuple(_p2p(cluster, a, c)[1] if a != c else dev.mem_bw_Bps for c in device_ids) for a in device_ids)
    lat = tuple(tuple(_p2p(cluster, a, c)[0] if a != c else 0.0 for c in device_ids) for a in device_ids)
    links = tuple(tuple(cluster.links_between(a, c) if a != c else () for c in device_ids) for a in device_ids)
    cap = int(mem_capacity_bytes if mem_capacity_bytes is not None else dev.memory_bytes)
    # the runtime's loss allreduce over the group, once per step (4 bytes: a latency)
    step_s = allreduce_time(LOSS_BYTES, list(device_ids), cluster) if m > 1 else 0.0
    notes = (f"{cluster.name}: {dev.name}, {dtype}",) + (
        (f"MP runtime: {node_s * 1e6:.1f} us of executor work per graph node (measured by `hybridpar profile`), "
         f"{step_s * 1e3:.3g} ms loss allreduce per step",) if node_s else ())
    post = cluster.measured_collective("p2p_post", 2)  # the sender's work per transfer (localhost)
    if post is not None:
        notes += (f"MP runtime: posting a transfer keeps the sender busy {post.intercept_s * 1e6:.0f} us "
                  f"+ {post.slope_s_per_byte * 1e9:.3g} ns/B (measured by `hybridpar profile`)",)
    notes += (f"optimizer step ({optimizer}) + zero_grad + train's NaN/Inf check: "
              f"{work.update_call_s * 1e6:.0f} us per device "
              f"+ {work.update_per_tensor_s * 1e6:.1f} us per tensor + {work.update_per_element_s * 1e9:.2g} ns "
              f"per parameter; loss {work.loss_call_s * 1e6:.0f} us + {work.loss_per_element_s * 1e9:.2g} ns "
              f"per output element ({work.source})",)
    return PlacementProblem(coarse.name, tuple(tasks), m, (cap,) * m, bw, lat, links, tuple(device_ids),
                            notes, step_s, program_order, post.intercept_s if post else 0.0,
                            post.slope_s_per_byte if post else 0.0, work.update_call_s, dev.time_share)


def executor_node_overhead_s(cluster: Cluster) -> float:
    """The MP executor's CPU work per graph node on this cluster's device: measured by `hybridpar
    profile` for the CPU device it calibrated (hybridpar.profile.executor; stretched like compute when
    ranks share cores), 0 elsewhere. On a GPU the interpreter's Python work runs ahead of the kernels
    it launches, so it is not on the step's critical path there."""
    dev = cluster.device
    if dev.kind != "cpu":
        return 0.0
    cal = load_calibration()
    if cal is None or cal.device_name != dev.name or cal.mp_node_overhead_s is None:
        return 0.0
    return cal.mp_node_overhead_s * dev.time_share


def _read_numel(consumer: Node, producer: str, prod: Node) -> int:
    """Elements of `producer`'s output that `consumer` reads: its input shape at that input where the
    graph records one (an LSTM whose last step alone is used sends that step, as the runtime does),
    else the whole output."""
    if len(consumer.in_shapes) == len(consumer.inputs) and producer in consumer.inputs:
        shape = consumer.in_shapes[consumer.inputs.index(producer)]
        if shape:
            return min(math.prod(shape), prod.out_numel)
    return prod.out_numel


def _p2p(cluster: Cluster, a: int, b: int) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of one activation transfer a -> b: the p2p transfer time measured by
    `hybridpar profile` where the cluster has one (localhost: gloo isend/irecv between two ranks, as the
    MP runtime sends), else the route's link figures. On localhost the link figures are read off an
    allreduce fit, which put a transfer's fixed cost at half an allreduce's; the measured p2p is what a
    transfer pays."""
    fit = cluster.measured_collective("p2p", 2)
    if fit is not None:
        return fit.intercept_s, (1.0 / fit.slope_s_per_byte if fit.slope_s_per_byte > 0 else float("inf"))
    return cluster.p2p_latency_s(a, b), cluster.p2p_bw_Bps(a, b)


def _activation_bytes(node: Node, kept: bool, b: int) -> float:
    """cost.memory.training_memory's activation rule for one node (the same function, so the sum over a
    graph's nodes equals training_memory's total; a test checks it)."""
    return cost_memory.node_kept_bytes(node, kept, b)


def placement_by_module(coarse: Graph, assignment: Sequence[int], fine: Graph | None = None) -> dict[str, int]:
    """module name -> device, plus fine node name -> device for the nodes no module runs (a branch
    concat, a residual add) when `fine` is given, so the runtime runs them where the placer scheduled
    them rather than next to their first input. A parameterless module called from nodes on two
    devices (a reused dropout) is left out as a module; its calls are then placed by node name."""
    out: dict[str, int] = {}
    clash: set[str] = set()
    leaves = dict(fine.meta).get(RUNTIME_LEAVES, ()) if fine is not None else ()
    for n, d in zip(coarse.nodes, assignment):
        mods = list(node_modules(n))
        for x in members(n) if fine is not None else ():
            fn = fine.by_name.get(x)
            if fn is None:
                continue
            # the modules owning its weights (nn.MultiheadAttention's in-projection is a node that no
            # module calls: its weights belong to the attention module) and the runtime leaf it is in
            mods += [owner_of(p) for p, _ in fn.param_shapes if owner_of(p)]
            mods += [leaf for leaf in [leaf_of(fn.attr("scope"), leaves)] if leaf]
        for mod in dict.fromkeys(mods):
            if out.get(mod, d) != d:
                clash.add(mod)
            out.setdefault(mod, d)
    out = {k: v for k, v in out.items() if k not in clash}
    # fine node names are torch.fx node names only when torch.fx traced the model (the runtime's names)
    if fine is not None and dict(fine.meta).get("tracer") == "torch.fx":
        for n, d in zip(coarse.nodes, assignment):
            for x in members(n):
                fn = fine.by_name.get(x)
                # functionals, and calls of a module left out above (a dropout used on two devices)
                if fn is not None and fn.op != "input" and (not fn.module or fn.module in clash):
                    out.setdefault(x, int(d))
    return out
