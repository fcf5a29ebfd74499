"""Timing inside a gloo world, shared by the side-by-side benchmarks."""

from __future__ import annotations

import time


def barrier_timed(fn) -> float:
    """Wall seconds of `fn()` between two barriers: every rank's share of a step, the slowest counted."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0
