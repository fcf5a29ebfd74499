"""Run inside spawned gloo ranks by test_dtensor_scope: our DTensor rules act inside a parallelized
module's forward (and its backward), and DTensor is stock everywhere else."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._tp_conv import convolution_backward_handler, convolution_handler

import hybridpar
from hybridpar.parallel.dtensor import rules

aten = torch.ops.aten


class Mixer(nn.Module):
    """A layer of ours (conv), a depthwise conv (not ours: our conv rule), and a plain mask the
    forward builds from the shapes it reads (our implicit replication), saved for the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        y = self.dw(torch.relu(self.conv(x)))
        mask = (torch.arange(y.shape[-1]) % 2).to(y.dtype)  # a plain tensor, same on every rank
        return self.head((y * mask).mean((2, 3)))


@contextlib.contextmanager
def _counting_row_convs():
    """Count the calls of our convolution rule while inside (yields the one-element counter)."""
    calls = [0]
    apply = rules._RowsConv.apply

    def counting(*args):
        calls[0] += 1
        return apply(*args)

    rules._RowsConv.apply = counting
    try:
        yield calls
    finally:
        rules._RowsConv.apply = apply


class Failing(nn.Module):
    def forward(self, x):
        raise ValueError("boom")


def _stock_state() -> dict:
    """What stock DTensor does here, outside any parallelized module's forward."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    table = DTensor._op_dispatcher._custom_op_handlers
    out = {"flag": torch._C._get_dtensor_allow_implicit_replication(),
           "conv_handler": table.get(aten.convolution.default) is convolution_handler,
           "conv_backward_handler": table.get(aten.convolution_backward.default) is convolution_backward_handler,
           "mode_active": torch.overrides._is_torch_function_mode_enabled()}
    d = DTensor.from_local(torch.ones(2, 3), mesh, [Replicate()], run_check=False)
    try:
        d * torch.ones(2, 3)  # stock: "got mixed torch.Tensor and DTensor"
        out["mix"] = "allowed"
    except RuntimeError as err:
        out["mix"] = "refused" if "mixed torch.Tensor and DTensor" in str(err) else f"other: {err}"
    with _counting_row_convs() as calls:
        x = DTensor.from_local(torch.randn(2, 4, 6, 6), mesh, [Shard(0)], run_check=False)
        w = DTensor.from_local(torch.randn(4, 1, 3, 3), mesh, [Replicate()], run_check=False)
        with contextlib.suppress(Exception):  # stock may refuse this sharding; ours must not be what ran
            F.conv2d(x, w, None, 1, 1, 1, 4)
    out["our_conv_calls"] = calls[0]
    return out


def run_scope() -> dict:
    torch.manual_seed(0)
    model = hybridpar.parallelize(Mixer(), "channel=2")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    with _counting_row_convs() as calls:
        for _ in range(2):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    after_step = _stock_state()
    failing = hybridpar.parallelize(Failing(), "channel=2")
    with contextlib.suppress(ValueError):
        failing(x)
    return {"inside_conv_calls": calls[0], "loss": float(loss), "after_step": after_step,
            "after_failed_forward": _stock_state()}
