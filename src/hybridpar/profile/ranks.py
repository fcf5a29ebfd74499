"""Start W local worker processes (one per rank) for a measurement and collect their failures.

Used by the profiler's probes (gloo collectives, framework memory): each runs `python -m <module>` once
per rank with single-threaded kernels, as a training rank on this host does."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence

from hybridpar.errors import UserError


def run_local_ranks(module: str, args: Sequence[str], world: int, timeout_s: float, what: str) -> list[str]:
    """Run `python -m module *args --rank r` for r < world; the last stderr line of each failed rank.
    A run past `timeout_s` is one UserError; every process is killed (only our own, by handle)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", module, *args]
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    deadline = time.monotonic() + timeout_s
    errors = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                errors.append(err.strip().splitlines()[-1] if err.strip() else f"exit {p.returncode}")
    except subprocess.TimeoutExpired:
        raise UserError(f"{what} with {world} ranks did not finish in {timeout_s:.0f} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return errors
