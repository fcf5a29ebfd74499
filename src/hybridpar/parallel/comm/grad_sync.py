"""Gradient synchronisation during backward, as DDP does it: every parameter's gradient joins a bucket
the moment autograd has accumulated it; a full bucket's allreduce is launched asynchronously while
backward goes on; a callback at the end of backward waits and writes the sums back. So the user's
`loss.backward(); optimizer.step()` sees synchronised gradients with no call of ours in between.

Written here rather than taken from DistributedDataParallel because the groups differ per parameter:
a weight shard of a channel/filter layer is summed only over the ranks holding the same shard (the
segmented allreduce of Dryden et al.), a replicated parameter whose DTensor gradient is Partial over
the channel_filter dimension is summed there too, and DDP supports one group per module. The one
gradient sync of the package: `parallelize`'s layouts and the model-parallel engine (each stage's
parameters over its data-parallel replicas) both use it, with the one bucket rule the planner prices
(hybridpar.layout.runs.BUCKET_BYTES).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement

from hybridpar.layout.runs import BUCKET_BYTES  # one rule: the planner prices these buckets
from hybridpar.parallel.comm.collectives import all_reduce_
from hybridpar.parallel.comm.log import CommLog
from hybridpar.parallel.mesh import Group

__all__ = ["BUCKET_BYTES", "GradSync"]


@dataclass
class _Bucket:
    group: Group
    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0

GroupOf = Callable[[torch.Tensor], Group | None]


class GradSync:
    """Hooks on every trainable parameter of a parallelized module.

    `groups(p)` names, for a plain (local-shard) parameter, the Group its gradient is summed over
    (None: nothing to do); DTensor parameters are summed over the group of the mesh dimensions on
    which their gradient is Partial (`mesh_groups[dim_name]`, or `mesh_groups[(name, name, ...)]`
    for several: their union), then laid out like the parameter.
    `average_over`: divide by the number of sample groups (DDP's convention, for per-rank losses).
    `overlap=False`: full buckets wait for the end of backward instead of starting during it.
    `ordered=True`: buckets are filled at the end of backward in parameter order, not in the order
    gradients became ready (spatial layouts: a rank whose piece of a layer's output is empty
    finishes that layer's gradients at another point of its backward than its peers, and buckets
    filled in ready order would then sum different parameters' gradients into each other)."""

    def __init__(self, params: Iterable[torch.Tensor], group_of: GroupOf,
                 mesh_groups: dict[str | tuple[str, ...], Group], log: CommLog, *, average_over: int = 1,
                 bucket_bytes: int = BUCKET_BYTES, overlap: bool = True, ordered: bool = False):
        self.params = [p for p in params if p.requires_grad]
        self.ordered = ordered
        self.group_of, self.mesh_groups, self.log = group_of, mesh_groups, log
        self.average_over, self.bucket_bytes, self.overlap = average_over, bucket_bytes, overlap
        self.enabled = True
        self._open: dict[int, _Bucket] = {}
        self._full: list[_Bucket] = []  # overlap=False: full buckets, started at the end of backward
        self._inflight: list[tuple[Any, _Bucket, torch.Tensor, torch.Tensor | None]] = []
        self._seen: set[int] = set()
        self._alone: list[torch.Tensor] = []  # parameters whose group is this rank alone (no collective)
        self._queued = False
        self.started_in_backward = 0  # buckets of the last backward started before it ended
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]
        self.launch_times: list[float] = []  # perf_counter() at each bucket launch (tests, benchmarks)
        self.buckets: list[tuple[tuple[int, ...], int]] = []  # the last backward's: (group ranks, bytes)
        self._rider: tuple[torch.Tensor, tuple[int, ...], str] | None = None
        self._rider_sent = False

    def carry(self, t: torch.Tensor, group, tag: str = "") -> None:
        """Send `t` (a few values, e.g. the step's loss for reporting) inside the next backward's first
        bucket over `group`: summed and divided as the gradients are, written back into `t` at the end
        of backward, logged as its own allreduce under `tag`. Why: a collective of its own costs its
        latency, not its bytes (2.5 ms between compute on 4 gloo ranks sharing 2 cores, 6% of a
        sample=4 step; NCCL's is ~10 us plus a stream sync). `carried()` after backward says whether
        it went; if not (no bucket on that group, another dtype, no_sync), the caller sends it itself."""
        self._rider, self._rider_sent = (t, tuple(group.ranks), tag), False

    def carried(self) -> bool:
        """Whether the value given to `carry` went with the gradients (and is summed now); resets."""
        sent, self._rider, self._rider_sent = self._rider_sent, None, False
        return sent

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally (micro-batches); the next backward outside syncs the sum."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    # -- during backward -------------------------------------------------------------------------
    def _ready(self, p: torch.Tensor) -> None:
        if not self.enabled:
            return
        if not self._queued:
            self._queued = True
            self.buckets = []
            self.started_in_backward = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self._seen.add(id(p))
        if isinstance(p, DTensor) or self.ordered:
            return  # DTensors: few and small (norm weights, scales), reduced by placement at the end
        self._add(p)

    def _add(self, p: torch.Tensor) -> None:
        group = self.group_of(p)
        if group is None or group.size == 1:
            self._alone.append(p)  # nothing to sum; still averaged (its samples span every group's loss)
            return
        grad = p.grad
        assert grad is not None  # a post-accumulate-grad hook: accumulated
        b = self._open.setdefault(id(group), _Bucket(group))
        b.params.append(p)
        b.grads.append(grad)
        b.nbytes += grad.numel() * grad.element_size()
        if b.nbytes >= self.bucket_bytes:
            full = self._open.pop(id(group))
            if self.overlap:
                self._launch(full)
                self.started_in_backward += 1
            else:
                self._full.append(full)

    def _add_in_order(self) -> None:
        """ordered=True: this backward's gradients into buckets, in parameter order."""
        for p in self.params:
            if id(p) in self._seen and not isinstance(p, DTensor):
                self._add(p)

    def _launch(self, b: _Bucket) -> None:
        rider = self._rider
        if rider is None or self._rider_sent or rider[1] != tuple(b.group.ranks) \
                or any(g.dtype != rider[0].dtype for g in b.grads):
            rider = None
        flat = _flatten_dense_tensors([*b.grads, rider[0]] if rider else b.grads)
        grad_bytes = sum(g.numel() * g.element_size() for g in b.grads)
        self.launch_times.append(time.perf_counter())
        self.buckets.append((tuple(b.group.ranks), grad_bytes))
        work = all_reduce_(flat, b.group, self.log, "grad_sync", async_op=True, log_bytes=grad_bytes)
        if rider:
            self._rider_sent = True
            self.log.record("allreduce", b.group.size, rider[0].numel() * rider[0].element_size(), rider[2])
        self._inflight.append((work, b, flat, rider[0] if rider else None))

    def _finish(self) -> None:
        self._queued = False
        if self.ordered:
            self._add_in_order()
        # Parameters autograd never reached (unused in this forward) still take part, as zeros, so
        # every rank issues the same collectives (and the bytes match the cost model's).
        for p in self.params:
            if id(p) in self._seen or isinstance(p, DTensor):
                continue
            group = self.group_of(p)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if group is None or group.size == 1:
                self._alone.append(p)
            else:
                b = self._open.setdefault(id(group), _Bucket(group))
                b.params.append(p)
                b.grads.append(p.grad)
        for full in self._full:
            self._launch(full)
        self._full.clear()
        for key in list(self._open):
            self._launch(self._open.pop(key))
        for work, b, flat, rider in self._inflight:
            if work is not None:
                work.wait()
            if self.average_over > 1:
                flat.div_(self.average_over)
            dests = [*b.grads, rider] if rider is not None else b.grads
            for g, synced in zip(dests, _unflatten_dense_tensors(flat, dests)):
                g.copy_(synced)
        self._inflight.clear()
        if self.average_over > 1:
            for p in self._alone:
                if p.grad is not None:
                    p.grad.div_(self.average_over)
        self._alone.clear()
        self._reduce_dtensor_grads()
        self._seen.clear()

    def _reduce_dtensor_grads(self) -> None:
        """Sum each DTensor gradient over the mesh dims it is Partial on, in one allreduce per set of
        such dims for all of them together (flattened): a gradient Partial over (sample,
        channel_filter) (an embedding's or a norm's under a channel/filter layout: each rank summed
        its own samples' share of the rows) is one sum over the whole mesh, not a sum over each dim
        in turn (which sent its bytes twice, in two collectives per parameter)."""
        done: list[tuple[DTensor, DTensor, torch.Tensor, list[Placement], int]] = []
        by_dims: dict[tuple[tuple[str, ...], torch.dtype], list[torch.Tensor]] = {}
        for p in self.params:
            if not isinstance(p, DTensor):
                continue
            g = p.grad
            if g is None:
                p.grad = torch.zeros_like(p)
                continue
            if not isinstance(g, DTensor):
                continue
            local = g.to_local()
            names = g.device_mesh.mesh_dim_names
            assert names is not None  # our meshes name their dims
            partial = [(names[d], pl) for d, pl in enumerate(g.placements)
                       if isinstance(pl, Partial) and self.mesh_groups[names[d]].size > 1]
            dims = tuple(name for name, _ in partial)
            if dims:  # same order on every rank: placements are the same everywhere
                by_dims.setdefault((dims, local.dtype), []).append(local)
            # Partial(avg): the mean of the ranks' values (a weight fed by a mean over a split dim, e.g.
            # x.mean((2, 3)) under height=2, has each rank's gradient from its own rows' mean): the sum
            # below divided by the ranks it ran over (summing alone doubled that gradient)
            averaged = prod(self.mesh_groups[name].size for name, pl in partial if _reduce_op(pl) == "avg")
            done.append((p, g, local, [Replicate() if pl.is_partial() else pl for pl in g.placements], averaged))
        for (dims, _), locals_ in by_dims.items():
            flat = _flatten_dense_tensors(locals_)
            all_reduce_(flat, self.mesh_groups[dims[0] if len(dims) == 1 else dims], self.log, "grad_sync")
            for t, synced in zip(locals_, _unflatten_dense_tensors(flat, locals_)):
                t.copy_(synced)
        for p, g, local, places, averaged in done:
            if self.average_over * averaged > 1:
                local.div_(self.average_over * averaged)
            out = DTensor.from_local(local, g.device_mesh, places, run_check=False, shape=g.shape,
                                     stride=g.stride())
            if tuple(places) != tuple(p.placements):
                out = out.redistribute(p.device_mesh, p.placements)
            p.grad = out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _reduce_op(pl: Partial) -> str:
    """A gradient's Partial is a sum or a mean of the ranks' values; any other reduction (max, min)
    has no gradient meaning here: refused rather than summed."""
    op = getattr(pl, "reduce_op", "sum")
    if op not in ("sum", "avg"):
        raise RuntimeError(f"a gradient Partial({op}) over the mesh cannot be synchronised (only sum and avg)")
    return op
