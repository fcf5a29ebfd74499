"""Built-in convergence curves for the paper's workloads, fitted to published points at load time."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from hybridpar.convergence.curve import ConvergenceModel, McCandlishCurve, curve_from_dict
from hybridpar.convergence.fit import fit_mccandlish
from hybridpar.errors import UserError


@dataclass(frozen=True)
class WorkloadCurve:
    """A convergence curve plus what the projection needs to turn epochs into steps."""

    model: str
    curve: ConvergenceModel
    samples_per_epoch: float | None
    target: str
    borrowed: bool = False
    why: str = ""

    def notes(self) -> list[str]:
        head = [self.why] if self.why else []
        return head + self.curve.notes()


@cache
def _data() -> dict[str, Any]:
    text = resources.files("hybridpar.convergence").joinpath("data/published.yaml").read_text()
    return yaml.safe_load(text)


def builtin_models() -> list[str]:
    return sorted(_data()["models"])


@cache
def workload_curve(workload: str) -> McCandlishCurve:
    """Fit the McCandlish law to a workload's published points (weights: stdev/sqrt(n), floored)."""
    data = _data()
    wl = data["workloads"].get(workload)
    if wl is None:
        raise UserError(f"unknown convergence workload {workload!r}; known: {', '.join(sorted(data['workloads']))}")
    floor = float(data["meta"]["quantisation_floor_epochs"])
    pts = wl["points"]
    se = [max(float(p["stdev"]), floor) / math.sqrt(int(p["n"])) for p in pts]
    return fit_mccandlish([p["batch"] for p in pts], [p["epochs"] for p in pts], se, name=workload)


def builtin_curve(model: str) -> WorkloadCurve:
    """The built-in curve for a zoo model (borrowed curves carry a widened b_noise uncertainty)."""
    models = _data()["models"]
    entry = models.get(model)
    if entry is None:
        raise UserError(f"no built-in convergence curve for model {model!r} (built-in: {', '.join(sorted(models))}); "
                        "measure one with `hybridpar measure-convergence --out curve.json` and pass "
                        "--convergence curve.json")
    wl = _data()["workloads"][entry["workload"]]
    curve = workload_curve(entry["workload"])
    why = str(entry.get("why", ""))
    if entry.get("borrowed"):
        extra = float(entry.get("b_noise_extra_rel_sd", 0.0)) * curve.b_noise
        cov = (curve.cov[0], (curve.cov[1][0], curve.cov[1][1] + extra**2))
        curve = replace(curve, name=f"{model} (borrowed from {entry['workload']})", cov=cov,
                        caveats=(*curve.caveats, why))
    spe = entry.get("samples_per_epoch", wl.get("samples_per_epoch"))
    return WorkloadCurve(model, curve, float(spe) if spe else None, str(wl.get("target", "")),
                         bool(entry.get("borrowed", False)), why)


def load_curve(path: str | Path, model: str = "custom") -> WorkloadCurve:
    """Read a curve JSON written by `hybridpar measure-convergence --out`."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"convergence curve file {str(path)!r} not found")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"convergence curve {str(path)!r} is not valid JSON: {err}") from None
    if not isinstance(d, dict):
        raise UserError(f"convergence curve {str(path)!r}: expected a JSON object")
    body = d.get("curve", d)
    curve = curve_from_dict(body)
    spe = d.get("samples_per_epoch")
    return WorkloadCurve(model, curve, float(spe) if spe else None, str(d.get("target", "")), False,
                         f"measured curve from {p.name}")
