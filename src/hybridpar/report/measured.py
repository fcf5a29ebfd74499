"""The measured side of a report: the JSON that `hybridpar train --json` prints.

The reader is tolerant on purpose: it takes the figures it knows (per-step loss and time, bytes per
collective kind) and ignores the rest, so a newer train output still renders.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from hybridpar.errors import UserError
from hybridpar.jsonfile import read_json

_TIME_KEYS = ("step_time_s", "time_s", "seconds", "wall_s")
_LOSS_KEYS = ("loss",)


@dataclass(frozen=True)
class Measured:
    """Figures measured by one training run."""

    source: str
    losses: tuple[float, ...] = ()
    step_times_s: tuple[float, ...] = ()
    comm_bytes: dict[str, int] = field(default_factory=dict)
    samples_per_s: float | None = None
    strategy: str | None = None
    world_size: int | None = None

    @property
    def step_time_s(self) -> float | None:
        """Median step time, first step left out (it includes warm-up) when there are several."""
        times = self.step_times_s[1:] if len(self.step_times_s) > 2 else self.step_times_s
        return median(times) if times else None


def _number(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise UserError(f"measured run {where}: expected a finite number, got {v!r}")
    return float(v)


def _first(d: dict, keys: tuple[str, ...]) -> Any:
    return next((d[k] for k in keys if k in d), None)


def _bytes_by_kind(obj: Any, where: str) -> dict[str, int]:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise UserError(f"measured run {where}: expected an object of kind -> bytes")
    return {str(k): int(_number(v, f"{where}.{k}")) for k, v in obj.items()}


def measured_from_dict(data: object, source: str = "<dict>") -> Measured:
    if not isinstance(data, dict):
        raise UserError(f"measured run {source}: expected a JSON object")
    steps = data.get("steps", [])
    if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        raise UserError(f"measured run {source}: 'steps' must be a list of objects")
    losses = [_number(_first(s, _LOSS_KEYS), f"steps[{i}].loss")
              for i, s in enumerate(steps) if _first(s, _LOSS_KEYS) is not None]
    times = [_number(_first(s, _TIME_KEYS), f"steps[{i}].time")
             for i, s in enumerate(steps) if _first(s, _TIME_KEYS) is not None]
    if not losses and isinstance(data.get("losses"), list):
        losses = [_number(v, f"losses[{i}]") for i, v in enumerate(data["losses"])]
    if not times and _first(data, _TIME_KEYS) is not None:
        times = [_number(_first(data, _TIME_KEYS), "step_time_s")]
    comm = _first(data, ("comm_bytes_per_step", "bytes_per_step", "comm_bytes"))
    if comm is None and steps and isinstance(steps[-1].get("comm_bytes"), dict):
        comm = steps[-1]["comm_bytes"]  # `hybridpar train --json`: per step; the last is steady state
    sps = _first(data, ("samples_per_s", "throughput"))
    if sps is None:
        rates = [_number(s["samples_per_s"], f"steps[{i}].samples_per_s")
                 for i, s in enumerate(steps) if s.get("samples_per_s") is not None]
        sps = median(rates[1:] if len(rates) > 2 else rates) if rates else None
    ws = data.get("world_size", data.get("nproc"))
    return Measured(
        source=source, losses=tuple(losses), step_times_s=tuple(times),
        comm_bytes=_bytes_by_kind(comm, "comm bytes"),
        samples_per_s=_number(sps, "samples_per_s") if sps is not None else None,
        strategy=str(data["strategy"]) if data.get("strategy") is not None else None,
        world_size=int(_number(ws, "world_size")) if ws is not None else None,
    )


def load_measured(path: str | os.PathLike) -> Measured:
    return measured_from_dict(read_json(path, "measured run"), str(path))
