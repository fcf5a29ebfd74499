"""Online gradient noise scale while training (`hybridpar train --gns`).

Each sample group (data-parallel replica) computes a gradient over its b_local = B/S samples before
the cross-group allreduce; after it every group holds the gradient over all B. Their squared norms
feed hybridpar.convergence.gns.GradientNoiseScale (McCandlish et al. 2018, app. A.1; Pollux):
    local = mean over the S groups of |g_group|^2,   global = |g|^2.
Gradients are split across the ranks of a group (channel/filter shards, or MP devices), so each rank
sums |.|^2 over the parameter pieces it alone holds in its group (a piece replicated in the group is
counted by its lowest group position only), and one 2-number allreduce over the world per step
(logged in the CommLog as kind "gns") adds up the pieces and the groups.

The per-rank gradient before the sync is sum_{own samples} grad(loss_i) / B (the engines divide by
the global batch), so the group's mean gradient is S times it."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.convergence.gns import GradientNoiseScale

GNS_BYTES = 16  # two float64 sums per step


class GradNoiseProbe:
    """Feed once per step with `after_step()` (gradients synced, optimizer not yet stepped).
    `reason` is None when the estimate is possible, else why not (then after_step returns None)."""

    def __init__(self, engine, global_batch: int, *, ema_decay: float = 0.95):
        self.engine = engine
        self.batch = global_batch
        self.groups, params, self.reason = _counted_params(engine, global_batch)
        self.estimator = GradientNoiseScale(ema_decay=ema_decay)
        self._params = params
        self._local: dict[int, torch.Tensor] = {}
        self._hooks = [] if self.reason else [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _on_grad(self, p: nn.Parameter) -> None:
        # fires after every accumulation (micro-batches too); the last one is the pre-sync gradient
        self._local[id(p)] = _local(p.grad).detach().double().pow(2).sum()

    def after_step(self) -> float | None:
        """Update the estimate with this step's gradients; returns the smoothed B_noise (samples), or
        None when it is not available (yet)."""
        if self.reason:
            return None
        device = _device_of(self._params)
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        for p in self._params:
            if id(p) in self._local:
                sums[0] += self._local[id(p)].to(device)
            if p.grad is not None:
                sums[1] += _local(p.grad).detach().double().pow(2).sum()
        self._local.clear()
        dist.all_reduce(sums)
        self.engine.comm_log.record("gns", dist.get_world_size(), GNS_BYTES, "gns")
        s = self.groups
        # mean over groups of |g_group|^2: a rank's pre-sync gradient is its group's mean gradient times
        # `pre_sync_scale` (1 when its loss is its samples' mean, 1/S when it is divided by the global batch)
        scale = getattr(self.engine, "pre_sync_scale", 1.0 / s)
        local_mean = float(sums[0]) / s / (scale * scale)
        global_sq = float(sums[1]) / s  # every group holds the same synced gradient
        self.estimator.update(local_mean, global_sq, self.batch // s, self.batch)
        value = self.estimator.estimate()
        return value if math.isfinite(value) and value > 0 else None

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient's local piece (a replicated parameter's share before its sync)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _device_of(params: list[nn.Parameter]) -> torch.device:
    from hybridpar.train.launch import current_device

    return current_device() if not params else params[0].device


def _counted_params(engine, batch: int) -> tuple[int, list[nn.Parameter], str | None]:
    """(sample groups S, the parameters whose gradient pieces this rank counts, reason if n/a)."""
    from hybridpar.parallel.pipeline.engine import MPEngine  # lazy: another package's engine

    if isinstance(getattr(engine, "mp_engine", engine), MPEngine):  # each weight whole on one device of its replica
        groups = engine.layout.dp
        params = [p for p in engine.parameters() if p.numel()]
    else:
        state = engine.state
        if len(state.grids) > 1:
            return 1, [], "n/a: per-layer layouts on more than one sample grid"
        groups = engine.grid.sample
        params = _unique_in_group(engine) if groups > 1 else []
    if groups < 2:
        return groups, [], "n/a: needs >1 sample group"
    if batch % groups:
        return groups, [], f"n/a: batch {batch} does not split evenly over {groups} sample groups"
    return groups, params, None


def _unique_in_group(engine) -> list[nn.Parameter]:
    """This rank's parameters that no lower position of its sample group holds as the same piece
    (same name and ranges of the undistributed tensor). Collective over the sample group (setup)."""
    shards = engine.state.shards()
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    mine = {n: _piece_key(shards.get(n)) for n, _ in named}
    grid = engine.grid
    if grid.g_size == 1:
        return [p for _, p in named]
    got: list[object] = [None] * grid.g_size
    dist.all_gather_object(got, (grid.g, mine), group=grid.sample_group.pg)
    first: dict[tuple, int] = {}
    for g, pieces in sorted(got, key=lambda t: t[0]):
        for n, key in pieces.items():
            first.setdefault((n, key), g)
    return [p for n, p in named if first[(n, mine[n])] == grid.g]


def _piece_key(info) -> tuple:
    return ("whole",) if info is None else (tuple(info.full_shape), tuple(info.dims))
