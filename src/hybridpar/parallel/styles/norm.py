"""Batch norm over channel-split, sample-split activations.

stats="global" (default): mean and variance over the whole global batch, so results equal serial
training. Each rank holds a channel piece; the ranks with the same piece in other sample groups
(the replica group) exchange per-channel statistics: one allreduce in forward and one in backward
(sum dy, sum dy*xhat). The forward's is of (count, count*mean, M2, count*mean^2) per rank in float64
(mean and M2 from two local passes), from which the global mean and M2 follow exactly as in Chan et
al.'s parallel variance: M2 = sum M2_i + sum n_i mean_i^2 - n mean^2, whose cancellation (mean^2 up
to ~1e4x the variance in real models) costs ~1e-12 in float64 and nothing visible in fp32. Its bytes
(3C+1 doubles) do not grow with the replica count, unlike torch's SyncBatchNorm's allgather of every
rank's (mean, invstd, count): 16.8 MB per layer at 1,024 replicas of 2,048 channels. A one-pass fp32
sum of squares (shifted by the running mean, 0 at step 0) lost 1.5e-4 relative on HF RegNet, where a
channel's mean^2 is 5,800x its variance; this gives it exactly (tests/parallel/test_batchnorm*).
stats="local": statistics of the rank's own samples only (no communication, like DDP without
SyncBatchNorm)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.parallel.comm.collectives import all_reduce_
from hybridpar.parallel.comm.log import CommLog
from hybridpar.parallel.mesh import Group


@dataclass(frozen=True)
class NormComm:
    replica_group: Group
    log: CommLog
    name: str


class GlobalBatchNormFunction(torch.autograd.Function):
    """Batch norm with statistics over the replica group, from PyTorch's fused CPU/GPU kernels:
    the local moments by `batch_norm_update_stats` (one kernel), the normalisation by `batch_norm` in inference form
    with the global mean and variance (one pass), the backward's two per-channel sums by
    `native_batch_norm_backward` (one pass) and the input gradient, an affine function of dy and x
    per channel, by an inference batch norm and an `addcmul_`. The elementwise formulas written out
    op by op took 9 ms of a 16-sample small_cnn step against 2.6 ms for nn.BatchNorm2d
    (torch.profiler, one rank, fake process group); torch's SyncBatchNorm kernels
    (batch_norm_stats, ...) have no CPU version."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, comm: NormComm, count: int):
        view = (1, -1, *([1] * (x.dim() - 2)))
        c = x.shape[1]
        n_loc = x.numel() // c
        # bf16/fp16 activations (autocast) are normalised in fp32, as cuDNN's batch norm does
        x_in = x
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.float()
        # mean and biased variance per channel, two passes in one kernel (the running-stats kernel
        # without running stats); var_mean over (0, 2, 3) was 4-5x slower on CPU
        if x.is_meta:  # the dry run (runtime.dry_run): that kernel has no meta version
            var_loc, m_loc = torch.var_mean(x, (0, *range(2, x.dim())), correction=0)
        elif n_loc == 0:  # an empty spatial piece (1 row over 2 ranks): it adds nothing to the sums
            m_loc = var_loc = x.new_zeros(c)
        else:
            m_loc, var_loc = torch.batch_norm_update_stats(x, None, None, 0.0)
        # one float64 allreduce; an allreduce gives every replica the same bits (the same sum on every
        # rank), so replicas stay identical
        m64 = m_loc.double()
        sums = torch.cat([m64.new_full((1,), float(n_loc)), n_loc * m64, n_loc * var_loc.double(),
                          n_loc * m64 * m64])
        all_reduce_(sums, comm.replica_group, comm.log, f"{comm.name}:fwd")
        n, s1, m2, q = sums[0], sums[1:1 + c], sums[1 + c:1 + 2 * c], sums[1 + 2 * c:]
        mean64 = s1 / n
        var64 = ((m2 + (q - n * mean64 * mean64)) / n).clamp_min(0.0)
        mean, var = mean64.to(x.dtype), var64.to(x.dtype)
        invstd = torch.rsqrt(var + eps)
        y = F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)
        ctx.save_for_backward(x_in, mean, invstd, weight)  # the input as it came (bf16 stays bf16)
        ctx.count, ctx.comm, ctx.eps, ctx.view = count, comm, eps, view
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar):
        x, mean, invstd, weight = ctx.saved_tensors
        comm, view = ctx.comm, ctx.view
        out_dtype = x.dtype
        x, dy = x.to(invstd.dtype), dy.to(invstd.dtype).contiguous()  # fp32 sums for bf16/fp16 activations
        # sum(dy * xhat) and sum(dy) per channel, fused (the weight's and bias's gradients)
        if x.numel():
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, x, weight, None, None, mean, invstd, True, ctx.eps, [False, True, True])
        else:  # an empty piece: its sums are zeros (the kernel refuses an empty input)
            sum_dy_xhat = sum_dy = invstd.new_zeros(invstd.shape)
        dx = None
        if ctx.needs_input_grad[0]:
            both = torch.cat([sum_dy, sum_dy_xhat])
            all_reduce_(both, comm.replica_group, comm.log, f"{comm.name}:bwd")
            g_dy, g_dy_xhat = both.split(sum_dy.numel())
            scale = invstd if weight is None else weight * invstd
            # dx = scale (dy - (g_dy + xhat g_dy_xhat) / count), xhat = (x - mean) invstd
            #    = scale dy + c0 + c1 x, per channel
            c1 = -scale * g_dy_xhat * invstd / ctx.count
            c0 = -scale * g_dy / ctx.count - c1 * mean
            # c1 x + c0 as an inference batch norm (mean 0, variance 1, eps 0): one fused pass, 3x
            # faster than a broadcast addcmul on CPU
            ones = torch.ones_like(c1)
            dx = F.batch_norm(x, torch.zeros_like(c1), ones, c1, c0, False, 0.0, 0.0)
            dx = dx.addcmul_(dy, scale.view(view)).to(out_dtype)
        # Parameter gradients stay local: the segmented allreduce sums them over sample groups.
        dw = sum_dy_xhat if weight is not None else None
        db = sum_dy if weight is not None else None
        return dx, dw, db, None, None, None


class DistBatchNorm(nn.Module):
    """BatchNorm1d/2d/3d over this rank's channel piece (parameters and running stats sliced), with
    statistics over the whole global batch (or, stats="local", over this rank's samples)."""

    meshes = None  # hybridpar.parallel.dtensor.boundary.Meshes when the model runs with global semantics

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, sl: slice, comm: NormComm, stats: str = "global"):
        super().__init__()
        if stats not in ("global", "local"):
            raise ValueError(f"stats must be 'global' or 'local', got {stats!r}")
        self.eps, self.momentum, self.stats, self.comm = bn.eps, bn.momentum, stats, comm
        self.track_running_stats = bn.track_running_stats
        self.weight: nn.Parameter | None = nn.Parameter(bn.weight.detach()[sl].clone()) if bn.affine else None
        self.bias: nn.Parameter | None = nn.Parameter(bn.bias.detach()[sl].clone()) if bn.affine else None
        self.running_mean: torch.Tensor | None
        self.running_var: torch.Tensor | None
        self.num_batches_tracked: torch.Tensor | None
        if bn.running_mean is not None and bn.running_var is not None and bn.num_batches_tracked is not None:
            self.register_buffer("running_mean", bn.running_mean[sl].clone())
            self.register_buffer("running_var", bn.running_var[sl].clone())
            self.register_buffer("num_batches_tracked", bn.num_batches_tracked.clone())
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

    rows_comm: NormComm | None = None  # spatial layouts: the sample replicas only (see forward)

    def forward(self, x):
        if self.meshes is None:
            return self._local_forward(x, x.shape[0] * self.comm.replica_group.size)
        from hybridpar.parallel.dtensor.boundary import boundary_placements, from_local, runtime_code, to_local

        with runtime_code():
            meshes = self.meshes
            places = boundary_placements(meshes, ndim=x.dim())
            if not meshes.spatial:
                y = self._local_forward(to_local(x, meshes, places), x.shape[0])
                return from_local(y, meshes, places, x.shape)
            # spatial splits: statistics over the samples' spatial pieces (comm's stats group); a tensor
            # with no dim for some split (BatchNorm1d on [N, F]) is whole on those ranks: its statistics
            # go over the sample replicas only and its parameters' gradients count once
            copies = math.prod(meshes.act.size(1 + i) for i in range(len(meshes.spatial))
                               if not places[1 + i].is_shard())
            count = x.shape[0] * math.prod(x.shape[2:])
            y = self._local_forward(to_local(x, meshes, places), x.shape[0], count=count,
                                    comm=self.comm if copies == 1 else self.rows_comm, copies=copies)
            return from_local(y, meshes, places, x.shape)

    def _local_forward(self, x: torch.Tensor, global_n: int, *, count: int | None = None,
                       comm: NormComm | None = None, copies: int = 1) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(f"{self.comm.name}: batch norm needs [N, C, ...] input, got {x.dim()}-D")
        if x.shape[1] == 0:  # an empty channel piece: so are its replicas' (same position), no statistics
            return x * 1.0
        use_batch = self.training or not self.track_running_stats
        if not use_batch:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False,
                                0.0, self.eps)
        comm = comm or self.comm
        weight: torch.Tensor | None = self.weight
        bias: torch.Tensor | None = self.bias
        if copies > 1:  # computed alike on `copies` ranks of the stats group: each gradient counts once
            from hybridpar.parallel.styles.spatial_layers import scale_grad

            weight, bias = scale_grad(weight, 1.0 / copies), scale_grad(bias, 1.0 / copies)
        if self.stats == "local" or comm.replica_group.size == 1:
            momentum = self._momentum()
            return F.batch_norm(x, self.running_mean, self.running_var, weight, bias, True,
                                momentum, self.eps)
        if count is None:
            count = global_n * math.prod(x.shape[2:])  # samples x positions per channel, whole batch
        y, mean, var = GlobalBatchNormFunction.apply(x, weight, bias, self.eps, comm, count)
        if self.track_running_stats:
            self._update_running(mean.detach(), var.detach(), count)
        return y

    def _momentum(self) -> float:
        if self.num_batches_tracked is not None and self.training:
            self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average, as nn.BatchNorm2d
            return 1.0 / float(self.num_batches_tracked) if self.num_batches_tracked else 0.0
        return self.momentum

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
        m = self._momentum()
        assert self.running_mean is not None and self.running_var is not None  # track_running_stats
        self.running_mean.mul_(1 - m).add_(mean, alpha=m)
        self.running_var.mul_(1 - m).add_(var * count / max(count - 1, 1), alpha=m)


DistBatchNorm2d = DistBatchNorm  # the name earlier releases used
