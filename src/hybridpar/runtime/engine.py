"""The training engine contract (docs/INTERFACES.md, "Runtime engine") and the channel/filter/sample
engine. `make_engine(module, plan)` hands plans with mp > 1 to hybridpar.runtime.mp.engine.MPEngine."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from hybridpar.errors import UserError
from hybridpar.plans import LayerLayout, Plan
from hybridpar.runtime.collectives import all_gather_dim, all_reduce_
from hybridpar.runtime.comm_log import CommLog
from hybridpar.runtime.conv import exchange_sizes
from hybridpar.runtime.parallelize import parallelize
from hybridpar.runtime.shard import piece_offsets, piece_sizes
from hybridpar.runtime.state import gather_full_state


class _GatherOutput(torch.autograd.Function):
    """Channel-split model output -> whole output on every rank of the sample group. Every rank then
    computes the same loss, counted once, so the backward is a slice with no communication."""

    @staticmethod
    def forward(ctx, out, engine: ChannelFilterEngine, sizes: list[int]):
        ctx.off, ctx.n = sum(sizes[:engine.grid.g]), sizes[engine.grid.g]
        return all_gather_dim(out, 1, engine.grid.sample_group, sizes, engine.comm_log, "output:fwd")

    @staticmethod
    def backward(ctx, d):
        return d.narrow(1, ctx.off, ctx.n).contiguous(), None, None


def local_slice(t: torch.Tensor, grid, split_channels: bool = True) -> torch.Tensor:
    """This rank's part of a global [N, C, ...] tensor: samples of its sample group and, when
    split_channels, its channel piece (dim 1 split into G pieces)."""
    n = t.shape[0] // grid.sample
    part = t[grid.s * n:(grid.s + 1) * n]
    if split_channels and grid.g_size > 1:
        part = part.narrow(1, piece_offsets(t.shape[1], grid.g_size)[grid.g],
                           piece_sizes(t.shape[1], grid.g_size)[grid.g])
    return part.contiguous()


def sync_gradients(module: nn.Module, grid) -> None:
    """Segmented allreduce: one flat allreduce per rank over the ranks holding the same shards, so
    the G replica groups (each with 1/G of the weights under channel=G) run concurrently. Layers on
    another grid than the default (a per-layer layout) sync over that grid's replica group."""
    state = getattr(module, "hybridpar", None)
    grids = state.grids if state is not None else {(grid.sample, grid.g_size): grid}
    owner = state.param_grid if state is not None else {}
    default = (grid.sample, grid.g_size)
    params = [p for p in module.parameters() if p.requires_grad]
    for key in sorted(grids):  # same order on every rank
        g = grids[key]
        mine = [p for p in params if owner.get(id(p), default) == key]
        if g.sample == 1 or not mine:
            continue
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in mine]
        flat = _flatten_dense_tensors(grads)
        all_reduce_(flat, g.replica_group, g.comm_log, "grad_sync")
        for p, gr in zip(mine, _unflatten_dense_tensors(flat, grads)):
            if p.grad is None:
                p.grad = gr
            else:
                p.grad.copy_(gr)


class ChannelFilterEngine:
    """Sample x channel x filter parallel training of a CNN on the current torch.distributed world."""

    def __init__(self, module: nn.Module, plan: Plan | LayerLayout | str, *, bn_stats: str = "global",
                 comm_log: CommLog | None = None, grid=None):
        self.module = parallelize(module, plan, bn_stats=bn_stats, comm_log=comm_log, grid=grid)
        self.state = module.hybridpar
        self.grid = self.state.grid
        self.comm_log: CommLog = self.grid.comm_log
        self._out_sizes: list[int] | None = None

    def parameters(self):
        return self.module.parameters()

    def param_bytes(self) -> int:
        """Bytes of this rank's parameters (its shards)."""
        return sum(p.numel() * p.element_size() for p in self.module.parameters())

    def param_bytes_by_type(self) -> dict[str, int]:
        """This rank's parameter bytes per layer type (conv, linear, norm, other)."""
        from hybridpar.runtime.conv import DistConv2d, DistLinear
        from hybridpar.runtime.norm import DistBatchNorm2d

        kinds = ((nn.Conv2d, DistConv2d), "conv"), ((nn.Linear, DistLinear), "linear"), \
            ((nn.modules.batchnorm._BatchNorm, DistBatchNorm2d), "norm")
        out: dict[str, int] = {}
        for m in self.module.modules():
            kind = next((k for types, k in kinds if isinstance(m, types)), "other")
            b = sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
            if b:
                out[kind] = out.get(kind, 0) + b
        return out

    def local_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's samples (sample group s) and input-channel piece (position g)."""
        return local_slice(x, self.grid), local_slice(y, self.grid, split_channels=False)

    @torch.no_grad()
    def warm_up(self, sample_shape: tuple[int, ...]) -> None:
        """One eval-mode forward of a dummy sample per sample group, so the one-time shape exchanges
        (Linear input pieces, output and concat widths) happen before training: parameters then have
        their final shapes when an optimizer or a checkpoint first sees them. Logged as setup;
        batch-norm running statistics are untouched (eval mode uses them without updating)."""
        was_training = self.module.training
        self.module.eval()
        try:
            with self.comm_log.setup_phase():
                x = torch.zeros(self.grid.sample, *sample_shape, device=self._device())
                self.forward(local_slice(x, self.grid))
        finally:
            self.module.train(was_training)

    def _device(self) -> torch.device:
        p = next(self.module.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def forward(self, x_loc: torch.Tensor) -> torch.Tensor:
        """Model output for this rank's samples, whole (gathered over the sample group)."""
        out = self.module(x_loc)
        if self.grid.g_size == 1:
            return out
        if self._out_sizes is None:
            self._out_sizes = exchange_sizes(out.shape[1], self.grid.sample_group, self.comm_log,
                                             "output:handshake", out.device)
        return _GatherOutput.apply(out, self, self._out_sizes)

    def train_step(self, x_loc: torch.Tensor, y_loc: torch.Tensor) -> float:
        """Forward, cross-entropy (mean over the global batch), backward, segmented gradient allreduce.
        Returns the global-batch mean loss (same on every rank)."""
        self.comm_log.mark_step()
        self.module.train()
        logits = self.forward(x_loc)
        global_n = x_loc.shape[0] * self.grid.sample
        loss = F.cross_entropy(logits, y_loc, reduction="sum") / global_n
        loss.backward()
        self.sync_gradients()
        value = loss.detach().clone().reshape(1)
        all_reduce_(value, self.grid.replica_group, self.comm_log, "loss")
        return float(value.item())

    def sync_gradients(self) -> None:
        sync_gradients(self.module, self.grid)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The undistributed model's state_dict on rank 0 (None elsewhere). Collective."""
        return gather_full_state(self.module.state_dict(), self.state.shards(), self.comm_log)


def make_engine(module: nn.Module, plan: Plan | LayerLayout | str, *, bn_stats: str = "global",
                micro_batches: int = 1, **kwargs):
    """The engine for `plan`: model parallel (mp > 1; `micro_batches` > 1 pipelines each replica's
    batch GPipe-style) or channel/filter/sample parallel (one micro-batch only). Other keyword
    arguments go to the chosen engine's constructor."""
    if isinstance(plan, Plan) and plan.mp > 1:
        from hybridpar.runtime.mp.engine import MPEngine  # lazy: another helper's package

        return MPEngine(module, plan, bn_stats=bn_stats, micro_batches=micro_batches, **kwargs)
    if micro_batches != 1:
        raise UserError(f"micro_batches={micro_batches} needs a model-parallel plan (mp > 1)")
    return ChannelFilterEngine(module, plan, bn_stats=bn_stats, **kwargs)
