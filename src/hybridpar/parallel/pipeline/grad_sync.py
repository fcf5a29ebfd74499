"""Gradient allreduce across the replicas of hybrid DP x MP, overlapped with backward.

Parameters are cut into buckets in reverse registration order (backward produces gradients
roughly in that order). A bucket's async allreduce starts as soon as all its gradients are
accumulated and every earlier bucket has started, so the buckets start in the same order on
every replica whatever order autograd finishes them in (as DDP does). `finish()` starts what is
left (parameters that got no gradient) and waits for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from hybridpar.parallel.comm.log import CommLog

BUCKET_BYTES = 1 << 20  # small buckets: more overlap on the small models this runs on CPU


def buckets_of(params: Sequence[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    out: list[list[nn.Parameter]] = []
    size = bucket_bytes
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if size + nbytes > bucket_bytes and (not out or out[-1]):
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return [b for b in out if b]


class GradSync:
    """Allreduce (sum) of this rank's gradients over its data-parallel group."""

    def __init__(self, params: Sequence[nn.Parameter], group, group_size: int, log: CommLog, *,
                 overlap: bool = True, bucket_bytes: int = BUCKET_BYTES):
        self.group, self.group_size, self.log, self.overlap = group, group_size, log, overlap
        self.buckets = buckets_of(params, bucket_bytes)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._armed = False
        self._ready = [0] * len(self.buckets)
        self._started = 0
        self._pending: list[tuple[object, torch.Tensor, list[torch.Tensor]]] = []
        self.started_in_backward = 0  # buckets of the last step started before backward ended
        if overlap:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self) -> None:
        """The next backward produces final gradients: start buckets as they fill."""
        self._armed = self.overlap
        self._ready = [0] * len(self.buckets)
        self._started = 0
        self._pending.clear()
        self.started_in_backward = 0

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._armed:
            return
        self._ready[self._bucket_of[id(p)]] += 1
        while self._started < len(self.buckets) and \
                self._ready[self._started] == len(self.buckets[self._started]):
            self._start(self._started)
            self.started_in_backward += 1

    def _start(self, i: int) -> None:
        self._started = i + 1
        grads = [p.grad for p in self.buckets[i] if p.grad is not None]
        if not grads:  # every replica skips the same bucket (same model, same unused weights)
            return
        flat = _flatten_dense_tensors(grads)
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self.log.record("allreduce", self.group_size, flat.numel() * flat.element_size(), "grad_sync")
        self._pending.append((work, flat, grads))

    def finish(self) -> None:
        """Start the remaining buckets, wait for all, write the sums back into the gradients."""
        self._armed = False
        while self._started < len(self.buckets):
            self._start(self._started)
        for work, flat, grads in self._pending:
            work.wait()
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        self._pending.clear()
