"""Repeated timing: warm-up runs, then the median and spread of `repeats` runs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from hybridpar.cluster.calibration import Measurement


def summarize(samples: Sequence[float]) -> Measurement:
    """Median, 10th and 90th percentile of timing samples (seconds)."""
    xs = sorted(samples)
    if not xs:
        raise ValueError("no timing samples")
    if len(xs) == 1:
        return Measurement(median_s=xs[0], p10_s=xs[0], p90_s=xs[0], repeats=1)
    q = statistics.quantiles(xs, n=10, method="inclusive")
    return Measurement(median_s=statistics.median(xs), p10_s=q[0], p90_s=q[-1], repeats=len(xs))


def measure(fn: Callable[[], object], *, warmup: int = 2, repeats: int = 10) -> Measurement:
    """Time `fn()` after `warmup` untimed calls; the median resists the odd preempted run."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return summarize(samples)
