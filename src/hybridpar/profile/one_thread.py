"""A profile step in a fresh single-threaded Python process (`python -m <module> ...`): what a rank gets
(one core), and process-global state (PyTorch's fake process group) that must not outlive the step.
Failures come back as one line (UserError)."""

from __future__ import annotations

import os
import subprocess
import sys

from hybridpar.errors import UserError


def run_module(module: str, args: list[str], what: str, timeout_s: float) -> str:
    """stdout of `python -m module *args` with one thread; `what` names it in a failure's line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    try:
        out = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise UserError(f"{what} did not finish in {timeout_s:.0f} s") from None
    if out.returncode != 0:
        last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
        raise UserError(f"{what} failed: {last}")
    return out.stdout
