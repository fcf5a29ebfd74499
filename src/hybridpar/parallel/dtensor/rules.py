"""Our rules for ops DTensor gets wrong or does not serve, so that user code between parallel layers
computes what it computes in one process.

- Convolutions that are not one of our layers (grouped/depthwise convs, Conv2d subclasses with their
  own forward, F.conv2d in user code): DTensor 2.13 sends `aten.convolution` to its width-sharded
  halo handler (`_tp_conv.py`), which is wrong for channel-split inputs and ignores register_sharding.
  We install our own handler in DTensor's custom-op table (the extension point torch's own loss- and
  context-parallel use): input gathered on channels and split on samples, weight whole, output split
  on samples; the weight gradient is Partial over samples and summed by GradSync. Correct for every
  convolution, at the price of running it replicated over channel_filter.
- Ops with no sharding strategy at all (e.g. `avg_pool3d_backward`, which LocalResponseNorm's
  backward needs): run them on whole (replicated) inputs, through `register_sharding`. Every such op
  is listed by the dry run (hybridpar.parallel.check) so that the planner can price it.
- Plain tensors meeting DTensors (an index tensor from `torch.arange`, a mask or position table a
  model builds from the shapes it reads, HF GPT-2's `logits[arange(batch), last_token]`): DTensor
  refuses such a mix ("got mixed torch.Tensor and DTensor"). Under our global semantics every rank
  holds the same plain tensor (inputs are the global batch, shapes read are global), so it is
  replicated, and we turn on DTensor's implicit replication (the flag behind
  `torch.distributed.tensor.experimental.implicit_replication`). The flag is thread-local: set in
  the thread that builds the model and, from the output's backward, in the thread autograd runs the
  backward in (a device thread on CUDA), since autograd saves the plain tensor and mixes it again.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

aten = torch.ops.aten

# Ops known to lack a DTensor strategy that users' models need; the dry run may add more.
REPLICATED_OPS = (aten.avg_pool3d_backward.default, aten.avg_pool2d_backward.default,
                  aten.max_pool2d_with_indices_backward.default,
                  aten.hardtanh_backward.default,  # ReLU6's backward (HF MobileNet): no strategy in 2.13
                  aten.hardswish_backward.default)  # Hardswish's (HF LeViT): none either

_installed: set = set()


def _meshed(t, placements, mesh, priced: bool = False):
    """`priced`: a move the planner prices itself (a whole conv's input gathered on channel_filter,
    cost.layout_comm.whole_conv_gathers), so the dry run does not add it to the plan again."""
    from hybridpar.parallel.dtensor.log import watched

    with watched(priced):  # logged as DTensor's redistributions between our layers are
        return t.redistribute(mesh, placements).to_local()


def _wrap(t: torch.Tensor, mesh, placements, n_global: int) -> DTensor:
    from hybridpar.parallel.dtensor.boundary import contiguous_stride

    shape = (n_global, *t.shape[1:]) if placements[0] == Shard(0) else tuple(t.shape)
    return DTensor.from_local(t, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=contiguous_stride(shape))


def _conv(op_call, args, kwargs):
    x, w, b, *rest = args
    mesh = x.device_mesh
    rows = [Shard(0), *([Replicate()] * (mesh.ndim - 1))]
    whole = [Replicate()] * mesh.ndim
    xl = _meshed(x, rows, mesh, priced=True)
    wl = _meshed(w, whole, mesh)
    bl = _meshed(b, whole, mesh) if isinstance(b, DTensor) else b
    y = op_call(xl, wl, bl, *rest, **kwargs)
    return _wrap(y, mesh, rows, x.shape[0])


def _conv_backward(op_call, args, kwargs):
    dy, x, w, *rest = args
    mesh = x.device_mesh
    rows = [Shard(0), *([Replicate()] * (mesh.ndim - 1))]
    whole = [Replicate()] * mesh.ndim
    dxl, dwl, dbl = op_call(_meshed(dy, rows, mesh), _meshed(x, rows, mesh, priced=True),
                            _meshed(w, whole, mesh), *rest, **kwargs)
    partial = [Partial(), *([Replicate()] * (mesh.ndim - 1))]  # this rank's samples' share
    return (None if dxl is None else _wrap(dxl, mesh, rows, x.shape[0]),
            None if dwl is None else _wrap(dwl, mesh, partial, 0),
            None if dbl is None else _wrap(dbl, mesh, partial, 0))


def install_conv_rule() -> None:
    table = DTensor._op_dispatcher._custom_op_handlers
    table[aten.convolution.default] = _conv
    table[aten.convolution_backward.default] = _conv_backward


def serve_replicated(ops) -> None:
    """Give each op (an OpOverload) a strategy that runs it on whole inputs, output whole."""
    from torch.distributed.tensor.experimental import register_sharding

    for op in ops:
        if op in _installed:
            continue

        def rule(*args, _op=op, **kwargs):
            ins = [Replicate() if hasattr(a, "shape") and hasattr(a, "ndim") else None for a in args]
            outs = [Replicate() for r in _op._schema.returns if "Tensor" in str(r.type)]
            return [(outs, ins)]

        register_sharding(op)(rule)
        _installed.add(op)


def replicate_plain_tensors() -> None:
    """This thread's DTensor ops treat plain tensors as replicated (see the module's doc)."""
    if not torch._C._get_dtensor_allow_implicit_replication():
        torch._C._set_dtensor_allow_implicit_replication(True)


def install(extra_ops=()) -> None:
    replicate_plain_tensors()
    install_conv_rule()
    serve_replicated((*REPLICATED_OPS, *extra_ops))
