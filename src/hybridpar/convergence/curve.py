"""Epochs to a target quality as a function of global batch size.

Two forms:
- `McCandlishCurve`: the empirical law of McCandlish et al. 2018 ("An Empirical Model of Large-Batch
  Training", arXiv:1812.06162, eq. 2.11): steps S(B) = S_min (1 + B_noise/B), equivalently
  epochs E(B) = E_min (1 + B/B_noise), with E_min = S_min * B_noise / samples_per_epoch.
  It carries the parameter covariance of its fit so callers can show an uncertainty band.
- `TableCurve`: measured points, interpolated linearly in log(B)-log(E).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hybridpar.errors import UserError


class ConvergenceModel(Protocol):
    """What the projection needs: epochs to target at a global batch, with a band."""

    name: str

    def epochs(self, batch: float) -> float: ...

    def epochs_band(self, batch: float, z: float = 1.0) -> tuple[float, float]: ...

    def notes(self) -> list[str]: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class McCandlishCurve:
    """E(B) = e_min * (1 + B / b_noise). `cov` is the 2x2 covariance of (e_min, b_noise)."""

    e_min: float
    b_noise: float
    cov: tuple[tuple[float, float], tuple[float, float]] = ((0.0, 0.0), (0.0, 0.0))
    name: str = "mccandlish"
    batch_range: tuple[float, float] | None = None  # the batches the fit saw; outside = extrapolation
    caveats: tuple[str, ...] = ()
    points: tuple[tuple[float, float, float], ...] = field(default=())  # (batch, epochs, stdev) fitted

    def __post_init__(self) -> None:
        if not (self.e_min > 0 and self.b_noise > 0 and math.isfinite(self.e_min) and math.isfinite(self.b_noise)):
            raise UserError(f"convergence curve {self.name!r}: need e_min > 0 and b_noise > 0, "
                            f"got e_min={self.e_min}, b_noise={self.b_noise}")

    def epochs(self, batch: float) -> float:
        return self.e_min * (1.0 + batch / self.b_noise)

    def steps(self, batch: float, samples_per_epoch: float) -> float:
        return self.epochs(batch) * samples_per_epoch / batch

    def epochs_band(self, batch: float, z: float = 1.0) -> tuple[float, float]:
        # Delta method: dE/de_min = 1 + B/Bn, dE/dBn = -e_min B / Bn^2.
        jac = np.array([1.0 + batch / self.b_noise, -self.e_min * batch / self.b_noise**2])
        sd = math.sqrt(max(float(jac @ np.array(self.cov) @ jac), 0.0))
        mid = self.epochs(batch)
        return max(mid - z * sd, 1e-12), mid + z * sd

    @property
    def e_min_sd(self) -> float:
        return math.sqrt(max(self.cov[0][0], 0.0))

    @property
    def b_noise_sd(self) -> float:
        return math.sqrt(max(self.cov[1][1], 0.0))

    def notes(self) -> list[str]:
        out = list(self.caveats)
        if self.batch_range:
            lo, hi = self.batch_range
            out.append(f"fitted on global batch {lo:g}..{hi:g}; outside that range the curve is extrapolated")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "mccandlish", "name": self.name, "e_min": self.e_min, "b_noise": self.b_noise,
                    "e_min_sd": self.e_min_sd, "b_noise_sd": self.b_noise_sd, "cov": [list(r) for r in self.cov],
                    "batch_range": list(self.batch_range) if self.batch_range else None,
                    "caveats": list(self.caveats),
                    "points": [{"batch": b, "epochs": e, "stdev": s} for b, e, s in self.points]}


@dataclass(frozen=True)
class TableCurve:
    """Measured (batch, epochs) points; log-log linear interpolation between them. Below the smallest
    batch epochs are held constant (E(B) flattens to E_min as B -> 0); above the largest the last
    segment's log-log slope is continued (flagged as extrapolation)."""

    batches: tuple[float, ...]
    epochs_: tuple[float, ...]
    stdevs: tuple[float, ...] = ()
    name: str = "table"
    caveats: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.batches) < 1 or len(self.batches) != len(self.epochs_):
            raise UserError(f"convergence table {self.name!r}: need matching batch and epoch lists")
        if any(b <= 0 for b in self.batches) or any(e <= 0 for e in self.epochs_):
            raise UserError(f"convergence table {self.name!r}: batches and epochs must be positive")
        if list(self.batches) != sorted(set(self.batches)):
            raise UserError(f"convergence table {self.name!r}: batches must be strictly increasing")

    def _interp(self, values: tuple[float, ...], batch: float) -> float:
        lb, lv = np.log(self.batches), np.log(values)
        x = math.log(batch)
        if len(lb) == 1 or x <= lb[0]:
            return float(math.exp(lv[0]))
        if x >= lb[-1]:
            slope = (lv[-1] - lv[-2]) / (lb[-1] - lb[-2])
            return float(math.exp(lv[-1] + max(slope, 0.0) * (x - lb[-1])))
        return float(math.exp(np.interp(x, lb, lv)))

    def epochs(self, batch: float) -> float:
        return self._interp(self.epochs_, batch)

    def epochs_band(self, batch: float, z: float = 1.0) -> tuple[float, float]:
        mid = self.epochs(batch)
        if not self.stdevs:
            return mid, mid
        rel = tuple(s / e for s, e in zip(self.stdevs, self.epochs_, strict=True))
        r = self._interp(tuple(max(v, 1e-12) for v in rel), batch) if any(rel) else 0.0
        return max(mid * (1 - z * r), 1e-12), mid * (1 + z * r)

    def notes(self) -> list[str]:
        return [*self.caveats, (f"measured table on batch {self.batches[0]:g}..{self.batches[-1]:g}; "
                "log-log interpolation, extrapolated beyond")]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "table", "name": self.name, "batches": list(self.batches), "epochs": list(self.epochs_),
                    "stdevs": list(self.stdevs), "caveats": list(self.caveats)}


def curve_from_dict(d: dict[str, Any]) -> McCandlishCurve | TableCurve:
    """Inverse of `to_dict` for both kinds (what `measure-convergence --out` writes)."""
    try:
        kind = d.get("kind", "mccandlish")
        if kind == "mccandlish":
            cov = d.get("cov") or [[d.get("e_min_sd", 0.0) ** 2, 0.0], [0.0, d.get("b_noise_sd", 0.0) ** 2]]
            br = d.get("batch_range")
            return McCandlishCurve(
                e_min=float(d["e_min"]), b_noise=float(d["b_noise"]),
                cov=(tuple(map(float, cov[0])), tuple(map(float, cov[1]))),  # type: ignore[arg-type]
                name=str(d.get("name", "mccandlish")), batch_range=tuple(br) if br else None,  # type: ignore[arg-type]
                caveats=tuple(d.get("caveats", ())),
                points=tuple((float(p["batch"]), float(p["epochs"]), float(p.get("stdev", 0.0)))
                             for p in d.get("points", ())))
        if kind == "table":
            return TableCurve(tuple(map(float, d["batches"])), tuple(map(float, d["epochs"])),
                              tuple(map(float, d.get("stdevs", ()))), str(d.get("name", "table")),
                              tuple(d.get("caveats", ())))
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"malformed convergence curve: {type(err).__name__}: {err}") from None
    raise UserError(f"unknown convergence curve kind {kind!r} (expected 'mccandlish' or 'table')")
