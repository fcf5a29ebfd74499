"""Starting the ranks: local gloo processes (`spawn`) or the world a launcher set up (torchrun).

`spawn(fn, nproc, *args)` runs fn(*args) in nproc fresh processes, each with torch.distributed
initialised (gloo, one intra-op thread), and returns rank 0's return value. `init()` joins a
torchrun world (NCCL when CUDA is present, else gloo).

Stopping: SIGINT or SIGTERM to the spawning process stops every rank (SIGTERM, then SIGKILL after
STOP_GRACE_S) and re-raises KeyboardInterrupt; a rank whose parent dies however it dies (even
SIGKILL) gets SIGTERM from the kernel (Linux). Checkpoints are atomic, so the last complete one
survives any of these."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hybridpar.host_allocator import (  # ranks reuse freed memory: no page faults per step
    huge_page_environment,
    keep_freed_memory,
    no_huge_pages,
)
from hybridpar.ports import free_port
from hybridpar.train.faults import ATTEMPT_ENV, set_default_timeout  # lost peer: error, not hang


def under_launcher() -> bool:
    """True when a launcher (torchrun) already set up this process's rank and world."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


_joined = False  # this process joined a launcher's world (init): it leaves without teardown (cli.main)


def joined_launcher() -> bool:
    return _joined


def init() -> torch.device:
    """Join the launcher's world; returns the device this rank computes on."""
    global _joined
    _joined = True
    keep_freed_memory()
    if dist.is_initialized():
        return _device()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # torchrun restarts reuse the agent's store: without a per-attempt prefix the new ranks read the
    # dead attempt's addresses and fail to connect (seen with torch 2.13 + gloo).
    timeout = set_default_timeout()
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    # The attempt is counted in the store, not read from TORCHELASTIC_RESTART_COUNT: over several nodes
    # that count differs (a node whose ranks did not fail restarts them uncounted), and the ranks of one
    # attempt would look for each other under different prefixes. Every rank of an attempt joins before
    # any of the next (torchrun stops them all first).
    attempt = (int(store.add("hybridpar/joined", 1)) - 1) // world
    os.environ[ATTEMPT_ENV] = str(attempt)
    store = dist.PrefixStore(f"hybridpar/attempt-{attempt}", store)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    return _device()


def current_device() -> torch.device:
    """The device this rank computes on: its CUDA device under NCCL, else the CPU."""
    return _device() if dist.is_initialized() else torch.device("cpu")


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


STOP_GRACE_S = 10.0  # how long stopped ranks get to exit on SIGTERM before SIGKILL


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux prctl
    PR_SET_PDEATHSIG); leave at once when the parent is already gone. Ranks (SIGTERM: they stop
    cleanly) and their loader workers (SIGKILL) use it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent is already gone
        os._exit(1)


# Ranks start from a fork server that imported torch and hybridpar once (per launching process):
# a fresh interpreter per rank spent ~3.5 s of CPU importing torch, which on a 2-core machine was
# most of a short run's start-up. The server forks before any thread or process group exists, so
# the ranks are as clean as spawned ones; they take the launcher's environment and directory
# (passed in `_entry`), not the server's, which the first spawn fixed.
START_METHOD = "forkserver" if sys.platform.startswith("linux") else "spawn"
_PRELOAD = ["torch", "torch.distributed", "hybridpar.train.launch", "hybridpar.train.trainer",
            "hybridpar.parallel.apply"]  # DTensor's import alone is ~3 s of CPU per rank


def preload(*modules: str) -> None:
    """Also import `modules` in the fork server, once, instead of in every rank (e.g. a model library
    the ranks import: transformers' modeling_utils costs ~6 s of CPU). Takes effect when the server
    starts, at this process's first spawn."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def context():
    """The multiprocessing context ranks (and queues shared with them) use."""
    import multiprocessing

    ctx = multiprocessing.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
        _start_fork_server()
    return ctx


def _start_fork_server() -> None:
    """Start the fork server (once per process) with glibc's huge-page tunable in its environment:
    only a process's start reads it, and the ranks fork from the server. A rank sharding weights with
    FSDP uses it (hybridpar.host_allocator.return_large_blocks); every other rank switches huge pages
    off for itself at start (`_entry`)."""
    from multiprocessing import forkserver

    saved = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"] = huge_page_environment(dict(os.environ))["GLIBC_TUNABLES"]
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["GLIBC_TUNABLES"]
        else:
            os.environ["GLIBC_TUNABLES"] = saved


def _entry(rank: int, world: int, port: int, out_path: str, fn, args, env=None) -> None:
    die_with_parent()
    if env is not None:  # the launcher's environment at this spawn, not the fork server's
        os.environ.clear()
        os.environ.update(env)
    keep_freed_memory()
    no_huge_pages()  # until this rank shards weights (hybridpar.parallel.fsdp): as without the server's tunable
    os.environ["OMP_NUM_THREADS"] = "1"  # ranks share the machine's cores
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=set_default_timeout())
    try:
        result = fn(*args)
        if rank == 0:
            torch.save(result, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A finished rank leaves without the interpreter's teardown: about 1 run in 15 of an MP training
    # aborted there ("terminate called without an active exception", no Python frame left) while C++
    # objects of torch.distributed were destroyed in an unlucky order. Everything this rank produced
    # is already written (result file above, progress queue flushed by its user, stdio below).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, nproc: int, *args, poll=None):
    """Run fn(*args) on nproc local gloo ranks; return rank 0's result (must be torch.save-able).
    fn must be importable (a module-level function). `poll()` is called every 0.1 s while the ranks
    run (e.g. to drain a progress queue). A rank's exception is re-raised here."""
    import logging

    import torch.multiprocessing as mp

    # torch logs a warning for every rank it stops after another failed; the failure itself is reported
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="hybridpar-") as tmp:
        out = str(Path(tmp) / "rank0.pt")
        previous = _on_sigterm_interrupt()
        try:
            context()  # the fork server's preload is set before it starts
            ctx = mp.start_processes(_entry, args=(nproc, free_port(), out, fn, args, dict(os.environ)),
                                     nprocs=nproc, join=False, start_method=START_METHOD)
            try:
                while not ctx.join(timeout=0.1):
                    if poll is not None:
                        poll()
            except BaseException:  # interrupted, or a rank failed: no rank outlives this call
                _stop(ctx.processes)
                raise
        finally:
            _restore_sigterm(previous)
        if poll is not None:
            poll()
        return torch.load(out, weights_only=False)


def _on_sigterm_interrupt():
    """SIGTERM to this process raises KeyboardInterrupt (as SIGINT does) while ranks run."""
    def handler(_sig, _frame):
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        return None


def _restore_sigterm(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def _stop(processes) -> None:
    """SIGTERM every live rank, then SIGKILL those still alive after STOP_GRACE_S."""
    live = [p for p in processes if p.is_alive()]
    for p in live:
        p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in live:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in live:
        if p.is_alive():
            p.kill()
            p.join(1.0)
