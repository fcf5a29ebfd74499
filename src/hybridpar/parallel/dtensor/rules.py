"""Our DTensor extensions, so that user code between parallel layers computes what it computes in one
process; switched on only inside a parallelized module's forward, as torch's own `loss_parallel()` and
`implicit_replication()` are context managers.

`DTensorRules` is a TorchFunctionMode that the parallelized module enters in a forward pre-hook and
leaves in a forward hook (hybridpar.parallel.styles.concat.install). While it is entered:
- Plain tensors meeting DTensors (an index tensor from `torch.arange`, a mask or position table a
  model builds from the shapes it reads, HF GPT-2's `logits[arange(batch), last_token]`): DTensor
  refuses such a mix ("got mixed torch.Tensor and DTensor"). Under our global semantics every rank
  holds the same plain tensor (inputs are the global batch, shapes read are global), so the mode
  wraps it as a replicated DTensor before the op (no communication). What autograd saves for the
  backward is then that DTensor, so the backward needs no switch at all: it runs in whatever thread
  autograd picks (a device thread on CUDA) with DTensor as stock. The mode also turns on DTensor's
  implicit replication (the thread-local flag behind `torch.distributed.tensor.experimental.
  implicit_replication`) for the forward's own thread, for the plain tensors torch's C++ code makes
  below the Python layer, and restores it on leaving.
- Convolutions that are not one of our layers (grouped/depthwise convs, Conv2d subclasses with their
  own forward, F.conv2d in user code) on DTensors: DTensor 2.13 sends `aten.convolution` to its
  width-sharded halo handler (`_tp_conv.py`), which is wrong for channel-split inputs and ignores
  register_sharding. The mode runs them through `_RowsConv`, an autograd Function: input gathered
  on channels and split on samples, weight whole, output split on samples; backward the same way,
  the weight gradient Partial over samples (summed by GradSync). Correct for every convolution, at
  the price of running it replicated over channel_filter. Being an autograd Function, its backward
  is ours wherever it runs; DTensor's own op table is never touched, so torch's conv on DTensors
  outside a parallelized module is torch's.

What is process-wide, and why: ops with no sharding strategy at all in torch get one. They are
backward ops, run by autograd after the forward's scope has closed, and DTensor's sharding cache
outlives any scope; a rule for an op stock DTensor refuses outright changes nothing that works stock.
- Elementwise backwards (`hardtanh_backward`: ReLU6's, HF MobileNet; `hardswish_backward`: HF LeViT's)
  get DTensor's own pointwise strategy (`serve_pointwise`, as torch registers its tagged pointwise
  ops): each output element from the same element of each input, so every split is kept and nothing
  moves, as the planner assumes for an activation.
- Average pooling backwards (`avg_pool2d_backward`, `avg_pool3d_backward`: LocalResponseNorm's) keep
  a split of the dims they do not pool over, samples and channels (`serve_planewise`); a split of a
  pooled dim (LocalResponseNorm pools over channels) is gathered.
- Any other op the caller names (`install(extra_ops)`) runs on whole inputs, output whole
  (`serve_replicated`): DTensor gathers its inputs over every mesh dimension.
All through `register_sharding` or torch's own registration. The dry run (hybridpar.parallel.check)
logs every gather DTensor makes as it runs, and what the planner does not price itself is added to
the plan's bytes from that log (hybridpar.api.plan).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch._ops import OpOverload
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding
from torch.distributed.tensor.placement_types import Placement
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from hybridpar.parallel.dtensor.boundary import contiguous_stride
from hybridpar.parallel.dtensor.log import watched

aten = torch.ops.aten

# Ops torch 2.13 gives DTensor no strategy for that users' models need (an op DTensor runs stock is
# never listed: a registered rule replaces torch's).
# Pooling backwards, by the trailing dims they pool over: each (sample, channel) plane is its own, so
# the leading dims keep their split (`serve_planewise`).
# (max_pool2d_with_indices_backward has torch's own strategy, which keeps them split too.)
POOLING_OPS = {aten.avg_pool2d_backward.default: 2,
               aten.avg_pool3d_backward.default: 3}  # LocalResponseNorm's: over (channels, 1, 1) of [N, 1, C, H, W]
# Elementwise backwards (not tagged pointwise in torch, so DTensor has no rule for them).
# log_sigmoid_backward is not here: its `buffer` argument may be empty (CUDA), not of the input's shape.
POINTWISE_OPS = (aten.hardtanh_backward.default,  # ReLU6's backward (HF MobileNet)
                 aten.hardswish_backward.default,  # Hardswish's (HF LeViT)
                 aten.hardsigmoid_backward.default, aten.hardshrink_backward.default,
                 aten.softshrink_backward.default)

# The convolutions of torch.nn.functional (nn.ConvNd's forward calls them), input, weight, bias first.
CONVS = frozenset({F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d})

_installed: set[OpOverload] = set()


def _meshed(t: DTensor, placements: list[Placement], mesh: DeviceMesh, priced: bool = False) -> torch.Tensor:
    """`priced`: a move the planner prices itself (a whole conv's input gathered on channel_filter,
    cost.layout_comm.whole_conv_gathers), so the dry run does not add it to the plan again."""
    with watched(priced):  # logged as DTensor's redistributions between our layers are
        return t.redistribute(mesh, placements).to_local()


def _wrap(t: torch.Tensor, mesh: DeviceMesh, placements: list[Placement], n_global: int) -> DTensor:
    shape = (n_global, *t.shape[1:]) if placements[0] == Shard(0) else tuple(t.shape)
    return DTensor.from_local(t, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=contiguous_stride(shape))


class _CaptureConv(TorchDispatchMode):
    """The aten.convolution call a torch.nn.functional convolution makes (its normalised arguments)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten.convolution.default:
            self.calls.append(tuple(args))
        return func(*args, **(kwargs or {}))


class _RowsConv(torch.autograd.Function):
    """A convolution on DTensors run on each sample group's whole input (see the module's doc)."""

    @staticmethod
    def forward(ctx, func: Callable, rest: tuple, kwargs: dict, x: DTensor, w: DTensor, b):
        mesh = x.device_mesh
        rows = [Shard(0), *([Replicate()] * (mesh.ndim - 1))]
        whole: list[Placement] = [Replicate()] * mesh.ndim
        xl = _meshed(x, rows, mesh, priced=True)
        wl = _meshed(w, whole, mesh)
        bl = _meshed(b, whole, mesh) if isinstance(b, DTensor) else b
        with torch._C.DisableTorchFunction(), _CaptureConv() as cap:
            y = func(xl, wl, bl, *rest, **kwargs)
        conv = cap.calls[0] if len(cap.calls) == 1 else None
        if conv is None or conv[0].shape != xl.shape:  # an input padded first (asymmetric 'same' padding)
            raise NotImplementedError(f"{func.__name__} with these arguments on DTensors under a channel/filter "
                                      "layout (the convolution does not read its input as given)")
        ctx.conv = conv[3:]  # bias_sizes-less tail: stride, padding, dilation, transposed, output_padding, groups
        ctx.bias = None if b is None else tuple(b.shape)
        ctx.save_for_backward(x, w)
        return _wrap(y, mesh, rows, x.shape[0])

    @staticmethod
    def backward(ctx, dy: DTensor):
        x, w = ctx.saved_tensors
        mesh = x.device_mesh
        rows = [Shard(0), *([Replicate()] * (mesh.ndim - 1))]
        whole: list[Placement] = [Replicate()] * mesh.ndim
        mask = [ctx.needs_input_grad[3], ctx.needs_input_grad[4], ctx.bias is not None and ctx.needs_input_grad[5]]
        dxl, dwl, dbl = aten.convolution_backward(
            _meshed(dy, rows, mesh), _meshed(x, rows, mesh, priced=True), _meshed(w, whole, mesh),
            list(ctx.bias) if ctx.bias is not None else None, *ctx.conv, mask)
        partial = [Partial(), *([Replicate()] * (mesh.ndim - 1))]  # this rank's samples' share
        return (None, None, None,
                None if dxl is None else _wrap(dxl, mesh, rows, x.shape[0]),
                None if dwl is None else _wrap(dwl, mesh, partial, 0),
                None if dbl is None else _wrap(dbl, mesh, partial, 0))


def _conv(func: Callable, args: tuple, kwargs: dict) -> Any:
    x, w = args[0], args[1]
    kwargs = dict(kwargs)
    b = args[2] if len(args) > 2 else kwargs.pop("bias", None)
    return _RowsConv.apply(func, tuple(args[3:]), kwargs, x, w, b)


def _mixed_mesh(args: Iterable, kwargs: dict) -> DeviceMesh | None:
    """The mesh of the DTensors among the arguments (one level of lists/tuples), when plain tensors
    with more than one element meet them (DTensor takes single-element ones as they are)."""
    mesh, plain = None, False
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, DTensor):
                mesh = t.device_mesh
            elif isinstance(t, torch.Tensor) and t.numel() != 1:
                plain = True
    return mesh if plain else None


def _replicated(a: Any, mesh: DeviceMesh) -> Any:
    if isinstance(a, (list, tuple)):
        return type(a)(_replicated(t, mesh) for t in a)
    if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.numel() != 1:
        return DTensor.from_local(a, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return a


class DTensorRules(TorchFunctionMode):
    """Our extensions of DTensor, on while the mode is entered (see the module's doc). Entered and
    left in one thread (a forward's); not reentrant."""

    def __enter__(self):
        self._flag = torch._C._get_dtensor_allow_implicit_replication()
        torch._C._set_dtensor_allow_implicit_replication(True)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            torch._C._set_dtensor_allow_implicit_replication(self._flag)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mesh = _mixed_mesh(args, kwargs)
        if mesh is not None:
            args, kwargs = _replicated(args, mesh), {k: _replicated(v, mesh) for k, v in kwargs.items()}
        if func in CONVS and len(args) > 1 and isinstance(args[0], DTensor) and isinstance(args[1], DTensor):
            return _conv(func, args, kwargs)
        return func(*args, **kwargs)


def serve_replicated(ops: Iterable[OpOverload]) -> None:
    """Give each op (an OpOverload) a strategy that runs it on whole inputs, output whole."""
    for op in ops:
        if op in _installed:
            continue

        def rule(*args, _op=op, **kwargs):
            ins = [Replicate() if hasattr(a, "shape") and hasattr(a, "ndim") else None for a in args]
            outs = [Replicate() for r in _op._schema.returns if "Tensor" in str(r.type)]
            return [(outs, ins)]

        register_sharding(op)(rule)
        _installed.add(op)


def serve_pointwise(ops: Iterable[OpOverload]) -> None:
    """Give each elementwise op DTensor's own pointwise strategy (each mesh dim: every tensor split on
    the same dim, broadcast dims whole, or all whole; uneven splits allowed), as torch registers the
    ops it tags pointwise (torch.distributed.tensor._ops._pointwise_ops, pinned torch)."""
    from torch.distributed.tensor._ops._pointwise_ops import _register_single_dim_pointwise

    for op in ops:
        if op not in _installed:
            _register_single_dim_pointwise(op)
            _installed.add(op)


def serve_planewise(ops: dict[OpOverload, int]) -> None:
    """Give each pooling backward (op -> the trailing dims it pools over) a strategy that keeps a split
    of any leading dim (samples, channels) on every tensor argument (the gradient, the input), else
    runs it whole."""
    for op, pooled in ops.items():
        if op in _installed:
            continue

        def rule(*args, _pooled=pooled, **kwargs):
            tensors = [hasattr(a, "shape") and hasattr(a, "ndim") for a in args]
            whole = ([Replicate()], [Replicate() if t else None for t in tensors])
            lead = max(0, args[1].ndim - _pooled)  # args[1]: the pooling's input
            return [whole, *(([Shard(d)], [Shard(d) if t else None for t in tensors]) for d in range(lead))]

        register_sharding(op)(rule)
        _installed.add(op)


def install(extra_ops: Iterable[OpOverload] = ()) -> None:
    """The process-wide part: strategies for the ops torch has none for (see the module's doc)."""
    serve_pointwise(POINTWISE_OPS)
    serve_planewise(POOLING_OPS)
    serve_replicated(extra_ops)
