"""Least-squares fit of the McCandlish law E(B) = e_min (1 + B / b_noise) to measured points."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
from scipy.optimize import OptimizeWarning, curve_fit

from hybridpar.convergence.curve import McCandlishCurve
from hybridpar.errors import UserError

# Upper bound for b_noise: beyond this the data show no batch dependence at all.
_B_NOISE_MAX = 1e9


def _model(b: np.ndarray, e_min: float, b_noise: float) -> np.ndarray:
    return e_min * (1.0 + b / b_noise)


def fit_mccandlish(batches: Sequence[float], epochs: Sequence[float], stdevs: Sequence[float] | None = None,
                   *, name: str = "fit", caveats: Sequence[str] = ()) -> McCandlishCurve:
    """Fit (e_min, b_noise) with their covariance.

    With `stdevs` (all > 0) the points are weighted by 1/stdev^2. The covariance is always scaled by
    the residual variance (reduced chi^2), so a law that misfits the data shows a wider band than the
    quoted run-to-run spread alone would give; that needs >= 3 points to say anything.
    """
    b = np.asarray(batches, dtype=float)
    e = np.asarray(epochs, dtype=float)
    if b.shape != e.shape or b.size < 2:
        raise UserError("convergence fit needs at least two (batch, epochs) points")
    if np.any(b <= 0) or np.any(e <= 0) or not np.all(np.isfinite(e)):
        raise UserError("convergence fit: batches and epochs must be positive and finite")
    if np.unique(b).size < 2:
        raise UserError("convergence fit needs at least two distinct batch sizes")
    sig = None
    if stdevs is not None:
        s = np.asarray(stdevs, dtype=float)
        if s.shape == b.shape and np.all(s > 0):
            sig = s
    notes = list(caveats)

    # Start from the straight line E = a + c B (a = e_min, c = e_min / b_noise).
    c, a = np.polyfit(b, e, 1, w=None if sig is None else 1.0 / sig)
    a = max(float(a), float(e.min()) * 0.5)
    b0 = a / c if c > 0 else _B_NOISE_MAX / 10
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizeWarning)
        popt, pcov = curve_fit(_model, b, e, p0=[a, min(max(b0, 1e-6), _B_NOISE_MAX / 10)], sigma=sig,
                               absolute_sigma=False,
                               bounds=([1e-12, 1e-9], [np.inf, _B_NOISE_MAX]), max_nfev=20000)
    e_min, b_noise = float(popt[0]), float(popt[1])
    if not np.all(np.isfinite(pcov)):
        notes.append("too few points for an uncertainty estimate (band shown as zero width)")
        pcov = np.zeros((2, 2))
    if b_noise >= _B_NOISE_MAX * 0.999:
        notes.append("epochs do not grow with batch in this data: b_noise is unbounded above")
    return McCandlishCurve(
        e_min=e_min, b_noise=b_noise,
        cov=((float(pcov[0, 0]), float(pcov[0, 1])), (float(pcov[1, 0]), float(pcov[1, 1]))),
        name=name, batch_range=(float(b.min()), float(b.max())), caveats=tuple(notes),
        points=tuple((float(x), float(y), float(sig[i]) if sig is not None else 0.0)
                     for i, (x, y) in enumerate(zip(b, e, strict=True))))
