"""Start-up phases of a run (issue 33): `hybridpar train` is silent for seconds while it loads and
traces the model, dry-runs the layout and starts the ranks; each phase is timed here and reported
as it ends (a listener the CLI sets), and kept for `train --json`'s `startup` object."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_phases: dict[str, float] = {}
_listener: list[Callable[[str, float], None]] = []


def listen(fn: Callable[[str, float], None] | None) -> None:
    """Start a fresh record of phases; `fn(name, seconds)` is told each one as it ends (None: nobody)."""
    _phases.clear()
    _listener[:] = [fn] if fn is not None else []


def record(name: str, seconds: float) -> None:
    _phases[name] = _phases.get(name, 0.0) + seconds
    for fn in _listener:
        fn(name, seconds)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as start-up phase `name` (recorded only when it completes: a refusal is the
    user's one line, not a phase)."""
    t0 = time.perf_counter()
    yield
    record(name, time.perf_counter() - t0)


def phases() -> dict[str, float]:
    """The phases recorded since `listen`, in order, seconds each."""
    return dict(_phases)
