"""Keep freed host memory in the process, so a training step does not page-fault on its own tensors.

PyTorch's CPU allocator takes every tensor from the C library's malloc. glibc serves large blocks
(above a threshold that starts at 128 KiB and moves with the process's history) with fresh mmaps,
and returns freed memory at the top of its heap to the OS: the next step's activations then
first-touch new pages, one minor fault per 4 KiB. Measured here (a branchy CNN, batch 32, one
process, `time.thread_time`): 95,000 faults and 287-415 ms per step with glibc's static 128 KiB
thresholds, 0 faults and 146-221 ms with freed memory kept; with glibc's defaults, 8,700-27,000
faults per step depending on the process's history, so the same step's time moved by tens of ms
between processes (the op table's profile, each rank of a run). PyTorch's CPU tuning guide
recommends an allocator that keeps memory (jemalloc/tcmalloc via LD_PRELOAD); neither ships with
pip, so we set glibc's own knobs (mallopt) the same way, once per process: in every rank
(hybridpar.train.launch) and in every process that times ops for the cost model
(hybridpar.profile), so that both see the same allocator.

The cost: a process keeps its peak heap until it exits (as the CUDA caching allocator does).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 1 << 30  # blocks up to 1 GiB come from the heap and are reused once freed
TRIM_THRESHOLD = (1 << 31) - 1  # never give the heap's top back to the OS
TOP_PAD = 64 << 20  # grow the heap 64 MiB at a time


@functools.cache
def keep_freed_memory() -> bool:
    """Configure this process's glibc malloc to keep and reuse freed memory. True when set (glibc on
    Linux); False elsewhere (another C library: nothing to set, nothing changes). Idempotent."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    # each knob on its own (a refused one must not leave the others unset); glibc builds that cap the
    # mmap threshold at 32 MiB (HEAP_MAX_SIZE / 2) refuse 1 GiB: take their cap then
    mmap_set = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 or mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1
    trim_set = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    pad_set = mallopt(_M_TOP_PAD, TOP_PAD) == 1
    return mmap_set and trim_set and pad_set
