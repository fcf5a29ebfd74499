"""Record of every p2p transfer and collective the MP/hybrid engine issues."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CommEvent:
    kind: str  # "send" | "recv" | "allreduce" | ...
    group_size: int
    bytes_: int
    phase: str = ""  # "fwd" | "bwd" | "grad" | "loss" | "state"
    peer: int | None = None  # the other device of a p2p transfer (index in the MP group)


@dataclass
class MPCommLog:
    events: list[CommEvent] = field(default_factory=list)

    def record(self, kind: str, group_size: int, bytes_: int, *, phase: str = "",
               peer: int | None = None) -> None:
        self.events.append(CommEvent(kind, group_size, int(bytes_), phase, peer))

    def totals(self) -> dict[str, int]:
        """Bytes per kind."""
        out: dict[str, int] = defaultdict(int)
        for e in self.events:
            out[e.kind] += e.bytes_
        return dict(out)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for e in self.events:
            out[e.kind] += 1
        return dict(out)

    def clear(self) -> None:
        self.events.clear()
