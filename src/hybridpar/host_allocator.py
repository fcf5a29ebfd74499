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

FSDP (`zero=2|3`) is the exception: each step it allocates and frees every block's gathered
parameters and gradient buffers (tens of MiB each), between the step's small allocations, and a heap
that never gives memory back fragments on that pattern: the resident set grew step by step to 1.0 GiB
for wide_cnn under `sample=2,zero=3` (benchmarks/_fsdp_bench_models.py, 2 ranks, AdamW), where its live
tensors peak near 0.7 GiB, and plain FSDP2 `fully_shard` by hand grew the same way. There, blocks of
4 MiB and more are mmapped and unmapped on free (`return_large_blocks`), which alone costs a page
fault per 4 KiB of every such block every step (1.7x the step); backed by transparent huge pages, one
fault per 2 MiB. glibc madvises huge pages for its mmaps only when its tunable `glibc.malloc.hugetlb=1`
is in the environment the process was started with, so the ranks' fork server starts with it
(`huge_page_environment`) and every rank that does not shard its weights switches transparent huge
pages off for itself (`no_huge_pages`): those keep exactly the behaviour above.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

# glibc's mallopt parameters (malloc.h); prctl's (linux/prctl.h)
_PR_SET_THP_DISABLE = 41
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


HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
LARGE_BLOCK = 4 << 20  # return_large_blocks: blocks from here up are mmapped and unmapped on free


def huge_page_environment(env: dict[str, str]) -> dict[str, str]:
    """`env` with glibc's tunable for huge-page mmaps added (other tunables kept)."""
    have = env.get("GLIBC_TUNABLES", "")
    if HUGE_PAGES_TUNABLE in have.split(":"):
        return dict(env)
    return {**env, "GLIBC_TUNABLES": f"{have}:{HUGE_PAGES_TUNABLE}" if have else HUGE_PAGES_TUNABLE}


def _thp_mode() -> str:
    """The kernel's transparent huge page mode: "always", "madvise" or "never" ("never" where unknown)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "never"
    return next((m for m in ("always", "madvise", "never") if f"[{m}]" in text), "never")


def _started_with_huge_pages() -> bool:
    """Whether this process's C library was started with the huge-page tunable (the environment it
    was exec'd with: a forked rank's is its fork server's) and the kernel lends huge pages."""
    try:
        with open("/proc/self/environ", "rb") as f:
            started = f.read().split(b"\0")
    except OSError:
        return False
    tunables = next((v[len(b"GLIBC_TUNABLES="):] for v in started if v.startswith(b"GLIBC_TUNABLES=")), b"")
    return HUGE_PAGES_TUNABLE.encode() in tunables.split(b":") and _thp_mode() != "never"


def _prctl_thp_disable(flag: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_THP_DISABLE, flag, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def no_huge_pages() -> bool:
    """Undo the fork server's tunable for this process: where the kernel lends huge pages only on
    request ("madvise") and glibc was started asking for them, this process takes none (Linux prctl),
    so a rank that keeps freed memory behaves as without the tunable. True when switched off; under
    "always" nothing changes (huge pages were the process's before the tunable too)."""
    return sys.platform.startswith("linux") and _thp_mode() == "madvise" and _started_with_huge_pages() \
        and _prctl_thp_disable(1)


def return_large_blocks() -> bool:
    """For a process that shards weights with FSDP: blocks of LARGE_BLOCK bytes and more are mmapped
    and unmapped when freed, backed by transparent huge pages (see the module docstring). Only where
    glibc was started with its huge-page tunable (else every such block would fault in 4 KiB pages
    every step): True when set, False when nothing changed (the process keeps freed memory)."""
    if not sys.platform.startswith("linux") or not _started_with_huge_pages():
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return _prctl_thp_disable(0) and mallopt(_M_MMAP_THRESHOLD, LARGE_BLOCK) == 1



def give_back_free_memory() -> bool:
    """Return the heap's free pages to the OS now (glibc's malloc_trim, which also releases whole free
    pages inside the heap): once, after a one-time release of many blocks (a model's whole weights
    replaced by their shards), which a heap that keeps freed memory would hold for the rest of the run."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    return bool(trim(0))
