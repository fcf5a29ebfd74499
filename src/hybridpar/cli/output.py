"""Shared output helpers: rich tables for people, --json for scripts.

Output that goes to a pipe or a file (`hybridpar inspect | cat`, batch-job logs) is laid out on a
console PIPE_WIDTH columns wide, so tables keep every cell whole (no `layer…`) and lines are not
wrapped; on a terminal, rich fits the terminal as usual."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console, ConsoleDimensions
from rich.table import Table

from hybridpar.humanize import fmt, human_bytes, human_flops, human_time

__all__ = ["console", "err_console", "fmt", "human_bytes", "human_flops", "human_time", "print_json", "table",
           "time_columns"]

PIPE_WIDTH = 10_000


class WideWhenPiped(Console):
    """A rich Console that is PIPE_WIDTH columns wide whenever its stream is not a terminal (rich
    would otherwise take $COLUMNS, or the width of whatever terminal stdin or stderr is, or 80).
    A width given to the constructor is kept."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fixed_width = kwargs.get("width") is not None

    @property
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)
        if not self._fixed_width and not self.is_terminal:
            return ConsoleDimensions(PIPE_WIDTH, size.height)
        return size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)


console = WideWhenPiped()
err_console = WideWhenPiped(stderr=True)


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=_default))


def _default(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    if hasattr(obj, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(obj)
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
          justify_right: Callable[[str], bool] | None = None) -> Table:
    t = Table(title=title, show_lines=False, header_style="bold")
    for c in columns:
        right = justify_right(c) if justify_right else c not in ("name", "layer", "model", "op", "module")
        t.add_column(c, justify="right" if right else "left")
    for r in rows:
        t.add_row(*[fmt(v) for v in r])
    return t


_TIME_UNITS = (("d", 86400.0), ("h", 3600.0), ("s", 1.0), ("ms", 1e-3), ("us", 1e-6))


def time_unit(values_s) -> tuple[str, float]:
    """The one unit for a column of durations: the largest that keeps the column's biggest value >= 1."""
    finite = [abs(v) for v in values_s if v is not None and math.isfinite(v) and v != 0]
    top = max(finite, default=1.0)
    return next(((u, s) for u, s in _TIME_UNITS if top >= s), _TIME_UNITS[-1])


def in_unit(v: float | None, scale: float) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    x = v / scale
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:,.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}" if abs(x) >= 0.01 else f"{x:.2g}"


def time_columns(headers: Sequence[str], columns: Sequence[Sequence[float | None]], *,
                 same_unit: bool = False) -> list[tuple[str, list[str]]]:
    """Durations (seconds) as table columns with one unit each, named in the header ('compute (ms)');
    `same_unit`: one unit for all the columns, so they compare at a glance."""
    units = [time_unit([v for col in columns for v in col])] * len(columns) if same_unit else \
        [time_unit(col) for col in columns]
    return [(f"{h} ({u})", [in_unit(v, s) for v in col]) for h, col, (u, s) in zip(headers, columns, units)]
