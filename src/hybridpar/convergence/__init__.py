"""hybridpar.convergence: statistical efficiency — epochs to a target vs global batch.

- `curve`: McCandlishCurve (E(B) = E_min (1 + B/B_noise), with a covariance band) and TableCurve.
- `fit.fit_mccandlish`: least-squares fit with parameter covariance.
- `builtin.builtin_curve(model)` / `load_curve(path)`: published curves (data/published.yaml) and
  curves written by `hybridpar measure-convergence`.
- `measure`: epochs-to-target on a real small task (sklearn digits).
- `gns.GradientNoiseScale`: online B_noise estimate for a training loop.

Names are imported lazily so that `import hybridpar.convergence.gns` from a training loop stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "McCandlishCurve": "curve", "TableCurve": "curve", "curve_from_dict": "curve",
    "fit_mccandlish": "fit", "builtin_curve": "builtin", "builtin_models": "builtin", "load_curve": "builtin",
    "WorkloadCurve": "builtin", "GradientNoiseScale": "gns", "measure": "measure",
}

__all__ = ["GradientNoiseScale", "McCandlishCurve", "TableCurve", "WorkloadCurve", "builtin_curve", "builtin_models",
           "curve_from_dict", "fit_mccandlish", "load_curve", "measure"]


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'hybridpar.convergence' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hybridpar.convergence.{mod}"), name)
