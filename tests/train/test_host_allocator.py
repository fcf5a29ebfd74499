"""Ranks (and the profile's timing processes) keep freed host memory: a training step's tensors reuse
it instead of first-touching fresh pages (hybridpar.host_allocator)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# 40 MB activations: above glibc's largest dynamic mmap threshold (32 MiB), so by default every one is
# a fresh mmap that faults ~10,000 pages in when written
WORKLOAD = textwrap.dedent("""
    import resource, sys, torch
    {setup}
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(12):  # the heap grows to the step's size first
        torch.ones(10 << 20)
    f0 = faults()
    for _ in range(10):
        torch.ones(10 << 20)
    print((faults() - f0) / 10)
""")


def _faults_per_step(setup: str) -> float:
    out = subprocess.run([sys.executable, "-c", WORKLOAD.format(setup=setup)], capture_output=True, text=True,
                         check=True, timeout=120)
    return float(out.stdout.split()[-1])


def test_keep_freed_memory_stops_page_faults_of_a_repeated_step():
    default = _faults_per_step("")
    kept = _faults_per_step("from hybridpar.host_allocator import keep_freed_memory; assert keep_freed_memory()")
    assert default > 5_000  # the test can fail: glibc's default faults the pages in every time
    assert kept < 100


def test_profile_timing_and_launched_ranks_keep_freed_memory():
    # the profile's timing module sets it on import; a rank sets it in launch (tested in a real rank below)
    assert _faults_per_step("import hybridpar.profile.timing") < 100


def _rank_faults() -> float:
    import resource

    import torch
    for _ in range(12):  # the heap grows to the step's size first
        torch.ones(10 << 20)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        torch.ones(10 << 20)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 10


def test_spawned_ranks_keep_freed_memory():
    from hybridpar.train.launch import spawn

    assert spawn(_rank_faults, 2) < 100
