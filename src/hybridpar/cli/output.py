"""Shared output helpers: rich tables for people, --json for scripts."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from hybridpar.humanize import fmt, human_bytes, human_flops, human_time

__all__ = ["console", "err_console", "fmt", "human_bytes", "human_flops", "human_time", "print_json", "table"]

console = Console()
err_console = Console(stderr=True)


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
