"""Time every op kind and shape of a model's graph, not a fixed list (issue 35).

`hybridpar.profile.ops` times the module kinds it knows (2-D conv, linear, batch norm, ReLU, the 2-D
poolings, LSTM) through forward hooks, with the runtime's variants of them (global-statistics batch
norm; the channel/filter layers of dist_layers). Everything else a model computes (Conv3d,
BatchNorm3d, MaxPool3d, scaled-dot-product attention, LayerNorm, GELU, embeddings, adds, softmax,
...) was left to the roofline. Here the model's own graph (`hybridpar.graph.trace`, the planner's)
says what to time: each node that does work, at the local shape of each (sample, channel, filter)
layout the plan considers for `splits` (the cost model's `local_shapes` rule, so the key is what
`op_time` looks up). The op is run as the model runs it: the fx node's own target on the arguments
it received in one real forward pass (torch.fx.Interpreter), its activations cut to the local shape.

What cannot be timed this way (an argument that cannot be cut to the local shape, an op that is not
a node of the runnable graph, an op that fails on a piece) is returned with the reason, so the plan
can say that its time is the roofline's (`Calibration.untimed`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import fx, nn

from hybridpar.cluster.calibration import OpRecord, format_key, format_op
from hybridpar.cost.compute import FREE_OPS, channels_last_layout, local_shapes
from hybridpar.graph.recurrent import record_op
from hybridpar.graph.types import NHWC_IN, Graph, Node
from hybridpar.profile.ops import as_nhwc
from hybridpar.profile.timing import clock, summarize, timed_grad

_SKIP = FREE_OPS  # graph plumbing and views: no work of their own, nothing to time


@dataclass
class Captured:
    """One fx node's callable and the real arguments it got in the forward pass."""

    fn: Callable
    args: tuple
    kwargs: dict
    weights: dict[str, torch.Tensor]  # a module's parameters and buffers (functional_call), else empty


@dataclass(frozen=True)
class GraphJob:
    key: str
    op: str  # as recorded: with its format and precision (cluster.calibration.format_op)
    node: str
    fracs: tuple[int, int, int]  # sample, channel, filter degrees
    memory_format: str = "nchw"
    precision: str = "fp32"  # bf16: as a bf16 autocast step runs it


Formats = tuple[tuple[str, str], ...]  # (memory format, precision) of each set of records


def graph_jobs(graph: Graph, splits: tuple[int, ...], covered: set[str],
               formats: Formats = (("nchw", "fp32"),)) -> list[GraphJob]:
    """One job per distinct (op, local shapes) key of the graph's working nodes at every layout of
    every k in `splits` (and whole), as the runtime runs each node there (cost.coverage.profile_keys:
    a depthwise conv whole over channels), leaving out keys in `covered` (measured by the hook path);
    again for each (memory format, precision) of `formats`: in "channels_last" only the nodes a
    channels-last run computes on NHWC memory (cost.compute.channels_last_layout)."""
    from hybridpar.cost.coverage import profile_keys

    keys = profile_keys(graph, splits)
    image = channels_last_layout(graph).image if any(mf == "channels_last" for mf, _ in formats) else frozenset()
    jobs = [GraphJob(format_key(key, mf, p), format_op(record_op(n), mf, p), n.name, lay, mf, p)
            for mf, p in formats for key, (n, lay) in keys.items()
            if format_key(key, mf, p) not in covered and (mf == "nchw" or n.name in image)]
    # ops the model's own forward hands NHWC inputs (graph.build's NHWC_IN): in channels_last too, whole
    # and at each sample piece (profile.ops.model_nhwc_variants, the hook path's twin)
    seen = {j.key for j in jobs} | set(covered)
    for p in dict.fromkeys(p for _, p in formats):
        for n in graph.nodes:
            if not n.attr(NHWC_IN) or n.op in FREE_OPS:
                continue
            for s in dict.fromkeys((1, *splits)):
                key = format_key(local_shapes(n, 1 / s).key(record_op(n)), "channels_last", p)
                if key not in seen:
                    seen.add(key)
                    jobs.append(GraphJob(key, format_op(record_op(n), "channels_last", p), n.name, (s, 1, 1),
                                         "channels_last", p))
    return jobs


@dataclass
class _Weight:
    """A parameter passed to a function as an argument (F.linear's weight in an exported graph): never
    cut with the activations, and its gradient timed as backward-weight."""

    tensor: torch.Tensor


class _Recorder(fx.Interpreter):
    """Runs the graph module and keeps the callable and arguments of the nodes asked for."""

    def __init__(self, gm: fx.GraphModule, wanted: set[str]):
        super().__init__(gm)
        self.wanted = wanted
        self.params: set[int] = {id(p) for p in gm.parameters()}
        self.got: dict[str, Captured] = {}

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if n.name in self.wanted and n.op in ("call_function", "call_method", "call_module"):
            from torch.utils._pytree import tree_map

            args, kwargs = self.fetch_args_kwargs_from_env(n)
            args, kwargs = tree_map(lambda t: _Weight(t.detach().clone()) if id(t) in self.params else t,
                                    (args, kwargs))
            args, kwargs = _detached((args, kwargs))
            if n.op == "call_module":
                mod = self.fetch_attr(n.target)
                weights = {k: v.detach().requires_grad_(v.is_floating_point())
                           for k, v in mod.named_parameters()}
                weights.update({k: v.detach() for k, v in mod.named_buffers()})  # never a gradient
                self.got[n.name] = Captured(mod, args, kwargs, weights)
            elif n.op == "call_method":
                name = n.target
                self.got[n.name] = Captured(lambda obj, *a, **k: getattr(obj, name)(*a, **k), args, kwargs, {})
            else:
                self.got[n.name] = Captured(n.target, args, kwargs, {})
        return out


def _detached(tree):
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


def capture(module: nn.Module, example_inputs: tuple, names: set[str], tracer: str = "torch.fx",
            precision: str = "fp32") -> dict[str, Captured]:
    """The callable and real arguments of the nodes named `names` in one forward pass of `module`,
    through the tracer the planner's graph came from (`tracer`: torch.fx's symbolic trace, or
    torch.export's graph, whose node names the graph keeps). Empty when it cannot trace the model:
    those ops are then reported untimed."""
    try:
        if tracer == "torch.export":
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                gm = torch.export.export(module, tuple(example_inputs), strict=False).module()
        else:
            gm = fx.symbolic_trace(module)
    except Exception:  # noqa: BLE001 - an untraceable model: its ops are listed untimed
        return {}
    from hybridpar.profile.ops import autocast

    rec = _Recorder(gm, names)
    with torch.no_grad(), autocast(precision):
        rec.run(*example_inputs)
    return rec.got


def _cut(t: torch.Tensor, full: tuple[int, ...], local: tuple[int, ...]) -> torch.Tensor:
    """An argument at the local shape: each dim the node's input is cut in, where the argument has
    that dim at its full size (one of another shape, e.g. a broadcast bias, is left whole). Whether the
    op then computes the local output is checked on its result."""
    out = t
    for d in range(min(t.dim(), len(full))):
        if t.shape[d] == full[d] and local[d] != full[d]:
            out = out.narrow(d, 0, local[d])
    return out


def _pieces(cap: Captured, node: Node, fracs: tuple[int, int, int], memory_format: str = "nchw"
            ) -> tuple[tuple, dict, dict]:
    s, c, f = fracs
    loc = local_shapes(node, 1 / s, 1 / c, 1 / f)
    full = tuple(node.in_shapes[0]) if node.in_shapes else ()
    from torch.utils._pytree import tree_map

    def cut(t):
        return _formatted(_cut(t, full, loc.x), memory_format, True) if isinstance(t, torch.Tensor) else t

    def weight(t):  # a parameter argument: never cut, in the run's format (4-D weights converted)
        return _Weight(_formatted(t.tensor, memory_format)) if isinstance(t, _Weight) else cut(t)

    args, kwargs = tree_map(weight, (cap.args, cap.kwargs), is_leaf=lambda t: isinstance(t, _Weight))
    # a module's per-channel weights (a norm's) follow a channel cut of its input: dim 0 = channels
    weights = {k: _formatted(v.narrow(0, 0, loc.x[1]) if len(full) > 1 and v.dim() >= 1 and v.shape[0] == full[1]
                             and loc.x[1] != full[1] else v, memory_format) for k, v in cap.weights.items()}
    return args, kwargs, weights


def _formatted(t: torch.Tensor, memory_format: str, activation: bool = False) -> torch.Tensor:
    """`t` contiguous, 4-D tensors channels-last in a channels-last job (as `train --channels-last`
    converts the model's 4-D weights and inputs, and convolutions keep their outputs so); an activation
    with the strides such a run gives it, even where `contiguous` would keep a 1x1 image's NCHW ones."""
    if memory_format == "channels_last" and t.dim() == 4:
        return as_nhwc(t) if activation else t.contiguous(memory_format=torch.channels_last)
    return t.contiguous()


def _run(cap: Captured, args, kwargs, weights) -> torch.Tensor:
    if isinstance(cap.fn, nn.Module):
        out = torch.func.functional_call(cap.fn, weights, args, kwargs)
    else:
        out = cap.fn(*args, **kwargs)
    if isinstance(out, (tuple, list)):
        out = next((o for o in out if isinstance(o, torch.Tensor)), None)
    if not isinstance(out, torch.Tensor):
        raise TypeError("its output is not a tensor")
    return out


def _floats(tree) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def time_job(cap: Captured, node: Node, job: GraphJob, *, device: str = "cpu", warmup: int = 2,
             repeats: int = 5) -> OpRecord:
    """Forward, backward-data (the activations' gradients) and backward-weight (the module's
    parameters') of one job; each repeat on fresh copies of the inputs, as a training step runs it.
    CPU time of this thread on a CPU (profile.timing), its kernels' time on a GPU (`gpu_kernel_time`). A bf16 job's
    forward runs under bf16 autocast, its backward outside, as a bf16 step runs them."""
    from hybridpar.profile.ops import autocast

    args, kwargs, weights = _pieces(cap, node, job.fracs, job.memory_format)
    arg_weights: list[torch.Tensor] = []

    def place(t):
        if isinstance(t, _Weight):  # a parameter argument: a leaf that needs its gradient
            arg_weights.append(t.tensor.to(device).requires_grad_(t.tensor.is_floating_point()))
            return arg_weights[-1]
        return t.to(device) if isinstance(t, torch.Tensor) else t

    from torch.utils._pytree import tree_map

    args, kwargs = tree_map(place, (args, kwargs), is_leaf=lambda t: isinstance(t, _Weight))
    weights = {k: v.to(device) for k, v in weights.items()}
    # parameters need a gradient (as captured), buffers (running statistics) not
    params = {k: v.detach().requires_grad_(cap.weights[k].requires_grad) for k, v in weights.items()}
    wrt_w = [p for p in (*params.values(), *arg_weights) if p.requires_grad]
    held = {id(w) for w in arg_weights}
    loc_y = local_shapes(node, *(1 / d for d in job.fracs)).y
    gpu = device.startswith("cuda")
    samples: list[list[float]] = [[], [], []]
    # a recurrent module's backward (LSTM/GRU/RNN) computes the input and weight gradients in one kernel
    # whichever autograd asks for: timed apart, each would be the whole backward (as the hook path, one)
    fused = node.op == "lstm"
    for k in range(warmup + repeats):
        a, kw = _fresh((args, kwargs), held)
        acts = [t for t in _floats((a, kw)) if id(t) not in held]

        def forward(a=a, kw=kw):
            with autocast(job.precision, device):
                return _run(cap, a, kw, params)
        if gpu:
            t_fwd, y = gpu_kernel_time(forward)
        else:
            t0 = clock()
            y = forward()
            t_fwd = clock() - t0
        if k == 0 and tuple(y.shape) != tuple(loc_y):
            raise ValueError(f"output {tuple(y.shape)} at the local shape, expected {tuple(loc_y)}")
        times = [t_fwd, 0.0, 0.0]
        if y.requires_grad and gpu:
            times[1:] = _gpu_backward(y, acts, wrt_w)
        elif y.requires_grad and fused:  # one backward kernel for both: timed once, filed as backward-data
            times[1] = timed_grad(y, acts + wrt_w, torch.randn_like(y), allow_unused=True)
        elif y.requires_grad:
            dy = torch.randn_like(y)
            if acts:
                times[1] = timed_grad(y, acts, dy, retain_graph=bool(wrt_w), allow_unused=True)
            if wrt_w:
                times[2] = timed_grad(y, wrt_w, dy, allow_unused=True)
        if k >= warmup:
            for i, t in enumerate(times):
                samples[i].append(t)
    fwd, bd, bw = (summarize(s) for s in samples)
    return OpRecord(key=job.key, op=job.op, fwd=fwd, bwd_data=bd,
                    bwd_weight=bw if wrt_w and not fused else None)


# On a GPU an op's time is its kernels' time, read by CUDA events with the stream held busy by a spin
# kernel (torch.cuda._sleep) while the host enqueues the op behind it: the events then bracket the op's
# kernels back to back, without the host's launch work (Python, functional_call, autograd's set-up)
# that a training step hides behind earlier kernels. Synchronised wall time, which this replaced, put
# ResNet-50's op table at 3.2x its measured step on an H200 (114.1 against 35.6 ms, batch 64): ~0.2 ms
# of host time per timed call. Where the host's enqueueing outlasts the spin (an op launching many
# kernels), the gap shows in the reading: the op is then launch-bound, as it would be in a step.
_SPIN_S = 3e-3
T = TypeVar("T")


@functools.cache
def _spin_cycles() -> int:
    """GPU clock cycles of a `_SPIN_S` spin: `torch.cuda._sleep` counts cycles, the clock varies."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n, fastest = 1_000_000, float("inf")
    for _ in range(5):  # the first spins wake the clock from idle: the fastest is the working clock's
        start.record()
        torch.cuda._sleep(n)
        end.record()
        end.synchronize()
        fastest = min(fastest, start.elapsed_time(end) * 1e-3)
    return max(10_000, int(n * _SPIN_S / max(fastest, 1e-6)))


def gpu_kernel_time(fn: Callable[[], T]) -> tuple[float, T]:
    """(seconds of the kernels `fn` launches, its result), on the current CUDA stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = _spin_cycles()
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3, out


def _gpu_backward(y: torch.Tensor, acts: list[torch.Tensor], wrt_w: list[torch.Tensor]) -> list[float]:
    """[backward-data, backward-weight] seconds on a GPU: the activations' gradients alone, and the
    rest of the whole backward (activations' and weights' gradients together, as a step asks) beyond
    them. Timed apart, an op whose backward kernel computes both at once (cuDNN's batch norm, an LSTM)
    would count it twice; the difference counts it once, whatever the kernel."""
    dy = torch.randn_like(y)
    data = 0.0
    if acts:
        data, _ = gpu_kernel_time(lambda: torch.autograd.grad(y, acts, dy, retain_graph=bool(wrt_w),
                                                              allow_unused=True))
    if not wrt_w:
        return [data, 0.0]
    whole, _ = gpu_kernel_time(lambda: torch.autograd.grad(y, acts + wrt_w, dy, allow_unused=True))
    return [data, max(0.0, whole - data)]


def _fresh(tree, held: set[int]):
    """Fresh copies of the float activations, needing gradients (a step's inputs are new each time);
    the parameter arguments (`held`) as they are."""
    from torch.utils._pytree import tree_map

    def fresh(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and id(t) not in held:
            return t.detach().clone().requires_grad_(True)
        return t

    return tree_map(fresh, tree)


def profile_graph_ops(module: nn.Module, example_inputs: tuple, graph: Graph, splits: tuple[int, ...],
                      covered: set[str], *, device: str = "cpu", warmup: int = 2, repeats: int = 5,
                      progress: Callable[[str], None] | None = None, formats: Formats = (("nchw", "fp32"),)
                      ) -> tuple[dict[str, OpRecord], dict[str, str]]:
    """(records by key, untimed key -> reason) for every job of `graph_jobs`."""
    jobs = graph_jobs(graph, splits, covered, formats)
    tracer = dict(graph.meta).get("tracer", "torch.fx")
    # the arguments each node got, per precision: under bf16 autocast a layer's output arrives as bf16
    got = {p: capture(module, example_inputs, {j.node for j in jobs if j.precision == p}, tracer, p)
           for p in dict.fromkeys(j.precision for j in jobs)}
    records: dict[str, OpRecord] = {}
    untimed: dict[str, str] = {}
    for job in jobs:
        if progress is not None:
            progress(f"{job.op} {job.key.split('|', 2)[1]}")
        cap = got[job.precision].get(job.node)
        if cap is None:
            untimed[job.key] = "not a node of torch.fx's trace of the model"
            continue
        try:
            records[job.key] = time_job(cap, graph.node(job.node), job, device=device, warmup=warmup,
                                        repeats=repeats)
        except Exception as err:  # noqa: BLE001 - any op that cannot run on a piece: listed, roofline used
            untimed[job.key] = f"{type(err).__name__}: {' '.join(str(err).split())[:120]}"
    return records, untimed
