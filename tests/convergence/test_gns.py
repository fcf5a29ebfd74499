import math

import numpy as np
import pytest

from hybridpar.convergence.gns import GradientNoiseScale


def _simulate(b_noise_true: float, ranks: int, b_local: int, steps: int, seed: int = 0,
              dim: int = 2000) -> GradientNoiseScale:
    """Per-sample gradients g_i = G + eps_i with Cov(eps) = s^2 I, so B_noise = dim s^2 / |G|^2."""
    rng = np.random.default_rng(seed)
    g_true = rng.standard_normal(dim)
    g_true /= np.linalg.norm(g_true)  # |G|^2 = 1
    s2 = b_noise_true / dim
    est = GradientNoiseScale(ema_decay=0.98)
    for _ in range(steps):
        # the mean of b_local per-sample gradients has noise covariance s^2 / b_local
        local = g_true + rng.standard_normal((ranks, dim)) * math.sqrt(s2 / b_local)
        glob = local.mean(axis=0)
        est.update(float((local**2).sum(axis=1).mean()), float((glob**2).sum()), b_local, b_local * ranks)
    return est


@pytest.mark.parametrize("b_noise", [50.0, 400.0, 3000.0])
def test_estimates_known_noise_scale(b_noise):
    est = _simulate(b_noise, ranks=4, b_local=16, steps=600)
    assert est.estimate() == pytest.approx(b_noise, rel=0.2)
    assert est.sq_grad_norm == pytest.approx(1.0, rel=0.2)


def test_more_noise_gives_larger_estimate():
    assert _simulate(100.0, 8, 8, 300).estimate() < _simulate(1000.0, 8, 8, 300).estimate()


def test_nan_before_data_and_rejects_bad_batches():
    est = GradientNoiseScale()
    assert math.isnan(est.estimate())
    with pytest.raises(ValueError):
        est.update(1.0, 1.0, 32, 32)
