"""CommLog: every collective (or point-to-point transfer) a runtime issued, with its kind, group size
and bytes, so a step's communication can be reported and checked against the cost model.

Byte convention (same as hybridpar.cost.collectives): the full buffer of one rank's tensor, i.e.
allreduce = the buffer, allgather = the gathered result, reduce_scatter = the input before
scattering, alltoall = the rank's input, send/recv = the message."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class CommRecord:
    kind: str  # "allreduce" | "allgather" | "reduce_scatter" | "alltoall" | "broadcast" | "send" | "recv"
    group_size: int
    bytes_: int
    tag: str = ""  # what issued it, e.g. "layers.0.conv1:fwd"
    setup: bool = False  # one-time exchanges (shape handshakes), excluded from per-step totals
    seconds: float = 0.0  # wall time this rank spent in the call (0: not timed; async: issue only)


class CommLog:
    """Append-only log; `mark_step()` starts a new step so per-step totals can be read back."""

    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self._step_start = 0
        self._setup_depth = 0

    def record(self, kind: str, group_size: int, bytes_: int, tag: str = "", setup: bool = False,
               seconds: float = 0.0) -> None:
        setup = setup or self._setup_depth > 0
        self.records.append(CommRecord(kind, int(group_size), int(bytes_), tag, setup, float(seconds)))

    @contextmanager
    def timed(self, kind: str, group_size: int, bytes_: int, tag: str = ""):
        """Record the collective issued inside, with the wall time it took on this rank (waiting for
        slower peers included: that is what a step pays)."""
        t0 = time.perf_counter()
        yield
        self.record(kind, group_size, bytes_, tag, seconds=time.perf_counter() - t0)

    @contextmanager
    def setup_phase(self):
        """Everything recorded inside counts as setup (e.g. a warm-up forward), not step traffic."""
        self._setup_depth += 1
        try:
            yield self
        finally:
            self._setup_depth -= 1

    def mark_step(self) -> None:
        self._step_start = len(self.records)

    def step_records(self) -> list[CommRecord]:
        """Records since the last mark_step(), without setup exchanges."""
        return [r for r in self.records[self._step_start:] if not r.setup]

    def step_bytes_by_kind(self) -> dict[str, int]:
        return bytes_by_kind(self.step_records())

    def step_seconds_by_kind(self) -> dict[str, float]:
        """Wall time in collectives since the last mark_step(), per kind (timed calls only)."""
        out: dict[str, float] = defaultdict(float)
        for r in self.step_records():
            if r.seconds:
                out[r.kind] += r.seconds
        return dict(sorted(out.items()))

    def total_bytes_by_kind(self) -> dict[str, int]:
        return bytes_by_kind([r for r in self.records if not r.setup])

    def clear(self) -> None:
        self.records.clear()
        self._step_start = 0


def bytes_by_kind(records) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for r in records:
        out[r.kind] += r.bytes_
    return dict(sorted(out.items()))
