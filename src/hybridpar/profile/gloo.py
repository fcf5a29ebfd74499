"""Measure gloo allreduce with real processes and fit the alpha-beta model to it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from hybridpar.errors import UserError
from hybridpar.profile.calibration import GlooFit, Measurement
from hybridpar.profile.timing import summarize

DEFAULT_SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_allreduce(world: int, sizes: Sequence[int] = DEFAULT_SIZES, *, warmup: int = 2,
                      repeats: int = 10, timeout_s: float = 180.0) -> list[Measurement]:
    """Run `world` gloo ranks as separate processes on this host and time allreduce at each size.
    A failed or hung benchmark is reported as one line (UserError), its processes killed."""
    if world < 2:
        raise UserError(f"gloo allreduce needs at least 2 ranks, got {world}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="hybridpar-gloo-") as tmp:
        out = Path(tmp) / "samples.json"
        cmd = [sys.executable, "-m", "hybridpar.profile.gloo_worker", "--world", str(world),
               "--port", str(_free_port()), "--sizes", ",".join(str(int(s)) for s in sizes),
               "--warmup", str(warmup), "--repeats", str(repeats), "--out", str(out),
               "--timeout", str(timeout_s)]
        procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for r in range(world)]
        deadline = time.monotonic() + timeout_s
        try:
            errors = []
            for p in procs:
                _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                if p.returncode != 0:
                    errors.append(err.strip().splitlines()[-1] if err.strip() else f"exit {p.returncode}")
        except subprocess.TimeoutExpired:
            raise UserError(f"gloo benchmark with {world} ranks did not finish in {timeout_s:.0f} s") from None
        finally:
            for p in procs:  # only our own children, by handle
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if errors or not out.exists():
            raise UserError(f"gloo benchmark with {world} ranks failed: {errors[0] if errors else 'no output'}")
        data = json.loads(out.read_text())
    return [summarize(s) for s in data["samples"]]


def fit_alpha_beta(world: int, sizes: Sequence[int], times: Sequence[Measurement]) -> GlooFit:
    """Fit T(n) = a + b n to the medians, minimising *relative* error (small sizes count as much as
    large ones), with a, b >= 0; then read the ring model T = 2(p-1) alpha + 2(p-1)/p n beta off it."""
    n = np.asarray(sizes, dtype=float)
    t = np.asarray([m.median_s for m in times], dtype=float)
    a_mat = np.column_stack([1.0 / t, n / t])
    (a, b), _ = nnls(a_mat, np.ones_like(t))
    resid = np.abs(a + b * n - t) / t
    p = world
    return GlooFit(world_size=p, intercept_s=float(a), slope_s_per_byte=float(b),
                   alpha_s=float(a) / (2 * (p - 1)), beta_s_per_byte=float(b) * p / (2 * (p - 1)),
                   sizes_bytes=[int(s) for s in sizes], times=list(times),
                   max_rel_residual=float(resid.max()))
