"""Online gradient-noise-scale estimate (McCandlish et al. 2018, appendix A.1; as used by Pollux).

With the squared norm of a gradient averaged over a small batch (b_small) and over a big batch
(b_big), both unbiased in expectation up to the noise term E|G_b|^2 = |G|^2 + tr(Sigma)/b:
    |G|^2     ~ (b_big |G_big|^2 - b_small |G_small|^2) / (b_big - b_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/b_small - 1/b_big)
and B_noise = tr(Sigma) / |G|^2. Each estimate is noisy, so both are smoothed with an exponential
moving average *before* the ratio is taken (the ratio of averages is far less biased than the average
of ratios). In data parallelism the per-rank gradient is the small batch and the allreduced gradient
the big one, so the estimate is free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class GradientNoiseScale:
    """Feed once per step; `estimate()` returns the smoothed B_noise (samples), or nan until it has data."""

    ema_decay: float = 0.95
    _g2: float = field(default=0.0, init=False)
    _trace: float = field(default=0.0, init=False)
    _weight: float = field(default=0.0, init=False)
    steps: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")

    def update(self, local_sq_norm_mean: float, global_sq_norm: float, b_local: int, b_global: int) -> None:
        """`local_sq_norm_mean`: mean over ranks of |g_rank|^2, each g_rank averaged over b_local samples;
        `global_sq_norm`: |g|^2 of the gradient averaged over all b_global samples."""
        if not b_global > b_local > 0:
            raise ValueError(f"need b_global > b_local > 0, got b_local={b_local}, b_global={b_global}")
        g2 = (b_global * global_sq_norm - b_local * local_sq_norm_mean) / (b_global - b_local)
        trace = (local_sq_norm_mean - global_sq_norm) / (1.0 / b_local - 1.0 / b_global)
        d = self.ema_decay
        self._g2 = d * self._g2 + (1 - d) * g2
        self._trace = d * self._trace + (1 - d) * trace
        self._weight = d * self._weight + (1 - d)  # debias the EMA's zero start (as Adam does)
        self.steps += 1

    @property
    def sq_grad_norm(self) -> float:
        """Smoothed estimate of |G|^2 (the true gradient's squared norm)."""
        return self._g2 / self._weight if self._weight else math.nan

    @property
    def trace_cov(self) -> float:
        """Smoothed estimate of tr(Sigma), the per-sample gradient covariance trace."""
        return self._trace / self._weight if self._weight else math.nan

    def estimate(self) -> float:
        """B_noise = tr(Sigma)/|G|^2; nan before the first update or while |G|^2 is not yet positive."""
        g2 = self.sq_grad_norm
        if not (g2 > 0):
            return math.nan
        return self.trace_cov / g2
