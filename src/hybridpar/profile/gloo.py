"""Measure gloo collectives with real processes (per kind and group size) and fit T(n) = a + b n."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from hybridpar.cluster.calibration import CollectiveFit, GlooFit, Measurement
from hybridpar.errors import UserError
from hybridpar.ports import free_port
from hybridpar.profile.ranks import run_local_ranks
from hybridpar.profile.timing import summarize

DEFAULT_SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)


def measure_allreduce(world: int, sizes: Sequence[int] = DEFAULT_SIZES, *, warmup: int = 2,
                      repeats: int = 10, timeout_s: float = 180.0) -> list[Measurement]:
    """Time allreduce over all `world` ranks at each size (see measure_collectives)."""
    return measure_collectives(world, sizes, ("allreduce",), (world,), warmup=warmup, repeats=repeats,
                               timeout_s=timeout_s)[("allreduce", world)]


def measure_collectives(world: int, sizes: Sequence[int] = DEFAULT_SIZES, kinds: Sequence[str] = ("allreduce",),
                        group_sizes: Sequence[int] | None = None, *, warmup: int = 2, repeats: int = 10,
                        timeout_s: float = 180.0) -> dict[tuple[str, int], list[Measurement]]:
    """Run `world` gloo ranks as separate processes on this host and time each collective kind, in
    groups of each size (all groups at once), at each size. Keyed by (kind, group size). A failed or
    hung benchmark is reported as one line (UserError), its processes killed."""
    if world < 2:
        raise UserError(f"gloo collectives need at least 2 ranks, got {world}")
    group_sizes = tuple(group_sizes or (world,))
    if any(g < 2 or world % g for g in group_sizes):
        raise UserError(f"group sizes {list(group_sizes)} must be divisors of {world} and >= 2")
    with tempfile.TemporaryDirectory(prefix="hybridpar-gloo-") as tmp:
        out = Path(tmp) / "samples.json"
        args = ["--world", str(world), "--port", str(free_port()), "--sizes", ",".join(str(int(s)) for s in sizes),
                "--kinds", ",".join(kinds), "--group-sizes", ",".join(map(str, group_sizes)),
                "--warmup", str(warmup), "--repeats", str(repeats), "--out", str(out), "--timeout", str(timeout_s)]
        errors = run_local_ranks("hybridpar.profile.gloo_worker", args, world, timeout_s, "gloo benchmark")
        if errors or not out.exists():
            raise UserError(f"gloo benchmark with {world} ranks failed: {errors[0] if errors else 'no output'}")
        data = json.loads(out.read_text())
    result = {}
    for key, rows in data["samples"].items():
        kind, g = key.split("/")
        result[(kind, int(g))] = [summarize(s) for s in rows]
    return result


def _fit_affine(sizes: Sequence[int], times: Sequence[Measurement]) -> tuple[float, float, float]:
    """T(n) = a + b n through the medians, minimising *relative* error (small sizes count as much as
    large ones), with a, b >= 0. Returns (a, b, worst relative residual)."""
    n = np.asarray(sizes, dtype=float)
    t = np.asarray([m.median_s for m in times], dtype=float)
    (a, b), _ = nnls(np.column_stack([1.0 / t, n / t]), np.ones_like(t))
    return float(a), float(b), float((np.abs(a + b * n - t) / t).max())


def fit_collective(kind: str, world: int, group_size: int, sizes: Sequence[int],
                   times: Sequence[Measurement]) -> CollectiveFit:
    a, b, resid = _fit_affine(sizes, times)
    return CollectiveFit(kind=kind, world_size=world, group_size=group_size, intercept_s=a, slope_s_per_byte=b,
                         sizes_bytes=[int(s) for s in sizes], times=list(times), max_rel_residual=resid)


def fit_alpha_beta(world: int, sizes: Sequence[int], times: Sequence[Measurement]) -> GlooFit:
    """Fit the allreduce times (see _fit_affine), then read the ring model
    T = 2(p-1) alpha + 2(p-1)/p n beta off it: the link figures the topology model needs."""
    a, b, resid = _fit_affine(sizes, times)
    p = world
    return GlooFit(world_size=p, intercept_s=a, slope_s_per_byte=b,
                   alpha_s=a / (2 * (p - 1)), beta_s_per_byte=b * p / (2 * (p - 1)),
                   sizes_bytes=[int(s) for s in sizes], times=list(times), max_rel_residual=resid)
