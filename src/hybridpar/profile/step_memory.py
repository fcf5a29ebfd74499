"""The memory one training step allocates, measured from torch's CPU allocator itself.

`torch.profiler` with `profile_memory=True` records every allocation and free of the CPU allocator
(bytes, address, time). Summed in time order they give the bytes a forward + backward has allocated
and not yet freed at every moment: its peak is the activation memory of the step (what autograd keeps
for backward, plus the largest transient of the backward) above what was live before it (weights,
gradients, the input batch), exactly and without the allocator's or the OS's slack that the resident
set adds (hybridpar.host_allocator keeps freed memory in the process).

Used by benchmarks/bench_memory.py (`--spatial`) and tests/cost/test_spatial_memory.py to compare a
spatially split rank's step with one process's, and with hybridpar.cost.memory's prediction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_MARK = "hybridpar.step_memory.forward"


@dataclass(frozen=True)
class StepMemory:
    """Bytes a step allocated and had not freed: at its peak, and at the end of its forward (what
    backward will read: the activations kept, the loss and its inputs)."""

    peak_bytes: int
    forward_bytes: int


def step_memory(forward: Callable[[], torch.Tensor]) -> StepMemory:
    """Run `forward()` (returning the loss) and its backward under the profiler; the step's memory.
    Gradients should already exist (a warm-up step, zero_grad(set_to_none=False)) so that only the
    step's own tensors count."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function(_MARK):
            loss = forward()
        loss.backward()
        del loss
    events = prof.profiler.kineto_results.events()
    fwd_end = max((e.end_ns() for e in events if e.name() == _MARK), default=None)
    live = peak = 0
    at_fwd = None
    for t, nbytes in _cpu_allocations(events):
        if at_fwd is None and fwd_end is not None and t > fwd_end:
            at_fwd = live
        live += nbytes
        peak = max(peak, live)
    return StepMemory(peak, live if at_fwd is None else at_fwd)


def _cpu_allocations(events) -> list[tuple[int, int]]:
    """(time, signed bytes) of the CPU allocator's events, in time order."""
    cpu = torch._C._autograd.DeviceType.CPU
    return sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == cpu)


# -- a zoo model's step: one process, and each rank of a layout ----------------------------------------

@dataclass(frozen=True)
class Case:
    """A zoo model at an input shape and global batch, with its factory's keyword overrides."""

    model: str
    shape: tuple[int, ...]
    batch: int
    kwargs: tuple[tuple[str, object], ...] = ()

    def build(self):
        """(the model, its input batch, its labels): per-pixel classes for a spatial output, else one
        class per sample (seeded: every rank builds the same)."""
        from hybridpar.graph.zoo import ZOO

        torch.manual_seed(0)
        model = ZOO[self.model].build(**dict(self.kwargs))
        x = torch.randn(self.batch, *self.shape, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            out = model(x)
        g = torch.Generator().manual_seed(2)
        y = torch.randint(0, out.shape[1], (out.shape[0], *out.shape[2:]), generator=g)
        return model, x, y


def measure_step(model, x: torch.Tensor, y: torch.Tensor) -> StepMemory:
    """A warm-up step (gradients then exist and stay: zero_grad(set_to_none=False)), then the step's
    memory (`step_memory`) with a cross-entropy loss. A parallelized model's gradient sync is off for
    that step (hybridpar.parallel.api.no_sync): its buckets are gradient memory (cost.memory's
    buckets_bytes), filled at the end of backward, and would hide the activations of a small model."""
    import contextlib

    import torch.nn.functional as F

    F.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=False)
    quiet = contextlib.nullcontext()
    if getattr(model, "hybridpar", None) is not None:
        from hybridpar.parallel.api import no_sync

        quiet = no_sync(model)
    with quiet:
        return step_memory(lambda: F.cross_entropy(model(x), y))


def rank_case(case: Case, strategy: str) -> list[StepMemory]:
    """On every rank of a world (hybridpar.train.launch.spawn): `case` parallelized with `strategy`;
    every rank's StepMemory."""
    import torch.distributed as dist

    from hybridpar.parallel import parallelize

    model, x, y = case.build()
    parallelize(model, strategy)
    mine = measure_step(model, x, y)
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    return got


def predicted_step_bytes(case: Case, strategy: str) -> float:
    """What hybridpar.cost.memory predicts a step allocates on one rank: the activations kept, the
    largest transient, and the model's output gathered whole (its I/O bytes less the input batch,
    which exists before the step)."""
    from hybridpar.cost.memory import predict_rank_memory
    from hybridpar.graph import trace

    model, x, _ = case.build()
    graph = trace(model, (x,), case.model)
    # framework_bytes None: a CPU rank (its unfolded convs' buffers); the sum below leaves the constant out
    mem = predict_rank_memory(graph, strategy, batch=case.batch)
    return mem.activations_bytes + mem.transient_bytes + mem.io_bytes - x.numel() * x.element_size()


def compare(case: Case, strategies: list[str]) -> dict:
    """One process's step (this process, the plain model) and each strategy's ranks (spawned), measured
    and predicted: {"one": {...}, strategy: {...}} with per-rank peaks, the largest, the prediction and
    the ratio of the largest to one process's peak."""
    from math import prod

    from hybridpar.train.launch import spawn

    model, x, y = case.build()
    one = measure_step(model, x, y)
    del model
    out = {"one": {"ranks": [one.peak_bytes], "peak_bytes": one.peak_bytes, "forward_bytes": one.forward_bytes,
                   "predicted_bytes": predicted_step_bytes(case, "sample=1")}}
    for s in strategies:
        n = prod(int(kv.split("=")[1]) for kv in s.split(","))
        ranks = spawn(rank_case, n, case, s)
        peak = max(r.peak_bytes for r in ranks)
        out[s] = {"ranks": [r.peak_bytes for r in ranks], "peak_bytes": peak,
                  "forward_bytes": max(r.forward_bytes for r in ranks),
                  "predicted_bytes": predicted_step_bytes(case, s), "vs_one": peak / one.peak_bytes}
    return out
