"""Repeated timing: warm-up runs, then the median and spread of `repeats` runs.

Times are CPU time of the calling thread (`clock`, time.thread_time), not wall-clock time: on a
shared machine the wall clock of an op also counts the time other jobs hold its core, which put the
op table at about twice a quiet step under load (issue 13); a thread's CPU time counts only its own
work. It needs the timed work to run on the calling thread: the profile runs torch single-threaded
(one rank = one core), and nothing timed here waits on another process.
"""

from __future__ import annotations

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
