"""Repeated timing: warm-up runs, then the median and spread of `repeats` runs.

Times are CPU time of the calling thread (`clock`, time.thread_time), not wall-clock time: on a
shared machine the wall clock of an op also counts the time other jobs hold its core, which put the
op table at about twice a quiet step under load (issue 13); a thread's CPU time counts only its own
work. It needs the timed work to run on the calling thread: the profile runs torch single-threaded
(one rank = one core), and nothing timed here waits on another process.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence

from hybridpar.cluster.calibration import Measurement
from hybridpar.host_allocator import keep_freed_memory

# Every process that times work for the cost model imports this module before it times anything:
# it times under the allocator settings the runtime's ranks train under (hybridpar.train.launch),
# else an op's time holds page faults (first touches of fresh memory) that a rank does not pay.
keep_freed_memory()


def summarize(samples: Sequence[float]) -> Measurement:
    """Median, 10th and 90th percentile of timing samples (seconds)."""
    xs = sorted(samples)
    if not xs:
        raise ValueError("no timing samples")
    if len(xs) == 1:
        return Measurement(median_s=xs[0], p10_s=xs[0], p90_s=xs[0], repeats=1)
    q = statistics.quantiles(xs, n=10, method="inclusive")
    return Measurement(median_s=statistics.median(xs), p10_s=q[0], p90_s=q[-1], repeats=len(xs))


clock = time.thread_time  # seconds of CPU time of the calling thread


def measure(fn: Callable[[], object], *, warmup: int = 2, repeats: int = 10) -> Measurement:
    """CPU time of `fn()` on this thread after `warmup` untimed calls; the median resists the odd
    slow run (a cache flushed by another job)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    return summarize(samples)


def grad_call_s() -> float:
    """CPU seconds one `torch.autograd.grad` call costs beyond its nodes' own backward work
    (`_grad_costs`)."""
    return _grad_costs()[0]


@functools.cache
def _grad_costs() -> tuple[float, float]:
    """(start-up, one tiny node's backward inside a chain) in CPU seconds. The start-up: what one
    `torch.autograd.grad` call costs beyond its nodes' own backward work: the
    engine's start-up (graph task, roots, the output buffers) that a training step pays once for its
    whole backward but an op timed on its own pays once per timed call. Measured on this thread: the
    backward of one tiny product alone, less what each tiny product costs inside one backward of a
    chain of them (2026-12-04, this VM: ~21 us alone against ~3 us inside a chain; a tiny BERT's op
    table, ~70 timed calls, summed to 4.7 ms against a whole measured step of 4.2 ms)."""
    import torch

    x = torch.randn(4, requires_grad=True)
    w = torch.randn(4)

    def alone() -> float:
        y = x * w
        dy = torch.ones_like(y)
        t0 = clock()
        torch.autograd.grad(y, (x,), dy)
        return clock() - t0

    def chain(n: int) -> Callable[[], float]:
        def run() -> float:
            y = x
            for _ in range(n):
                y = y * w
            dy = torch.ones_like(y)
            t0 = clock()
            torch.autograd.grad(y, (x,), dy)
            return clock() - t0
        return run

    fns = (alone, chain(8), chain(40))
    samples: list[list[float]] = [[], [], []]
    for k in range(60):
        for i, fn in enumerate(fns):
            t = fn()
            if k >= 10:
                samples[i].append(t)
    one, short, long_ = (statistics.median(v) for v in samples)
    per_node = max(0.0, (long_ - short) / 32)
    return max(0.0, one - per_node), per_node


def timed_grad(*args, **kwargs) -> float:
    """Run `torch.autograd.grad(*args, **kwargs)`; the CPU seconds of its backward work: the call's
    time less the engine start-up a step pays once (`grad_call_s`), never below what a tiny node's
    backward costs inside a step (a backward is never free: a cheap op's timing noise must not make it so)."""
    import torch

    start_up, node = _grad_costs()
    t0 = clock()
    torch.autograd.grad(*args, **kwargs)
    return max(node, clock() - t0 - start_up)
