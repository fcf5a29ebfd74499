"""Rank 0 reads its peak memory every step (StepInfo.peak_memory_bytes) through a descriptor kept open:
the same figure as /proc/self/status says, and a forked child's own, not its parent's."""

from __future__ import annotations

import os
import sys

import pytest

from hybridpar.train import metrics

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")


def _status_hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))


def test_the_kept_descriptor_reads_this_process_s_peak():
    assert metrics.peak_memory_bytes("cpu") == _status_hwm()
    grown = bytearray(64 * 2**20)
    grown[::4096] = b"x" * len(grown[::4096])  # touched: the resident set grows past the old peak
    assert metrics.peak_memory_bytes("cpu") == _status_hwm()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's own figure, though its parent's descriptor came along
        os.close(r)
        del grown
        metrics.reset_peak_memory("cpu")
        ok = metrics.peak_memory_bytes("cpu") == _status_hwm() and metrics._STATUS[0] == os.getpid()
        os.write(w, b"1" if ok else b"0")
        sys.stdout.flush()
        os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.waitpid(pid, 0)
    os.close(r)
