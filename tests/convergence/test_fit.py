import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpar.convergence.curve import McCandlishCurve, TableCurve, curve_from_dict
from hybridpar.convergence.fit import fit_mccandlish
from hybridpar.errors import UserError

BATCHES = [32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


@settings(max_examples=25, deadline=None)
@given(e_min=st.floats(0.5, 100.0), b_noise=st.floats(50.0, 5000.0))
def test_fit_recovers_noiseless_parameters(e_min, b_noise):
    truth = McCandlishCurve(e_min, b_noise)
    fit = fit_mccandlish(BATCHES, [truth.epochs(b) for b in BATCHES])
    assert fit.e_min == pytest.approx(e_min, rel=1e-4)
    assert fit.b_noise == pytest.approx(b_noise, rel=1e-4)


@pytest.mark.parametrize("seed", range(5))
def test_fit_recovers_noisy_parameters_within_its_uncertainty(seed):
    rng = np.random.default_rng(seed)
    truth = McCandlishCurve(e_min=12.0, b_noise=700.0)
    b = np.repeat(BATCHES, 3)
    e = np.array([truth.epochs(x) for x in b]) * (1 + 0.03 * rng.standard_normal(b.size))
    sd = 0.03 * np.array([truth.epochs(x) for x in b])
    fit = fit_mccandlish(b, e, sd)
    # within 4 standard deviations of the fit's own uncertainty, and that uncertainty is informative
    assert abs(fit.e_min - 12.0) < 4 * fit.e_min_sd and fit.e_min_sd < 0.1 * 12.0
    assert abs(fit.b_noise - 700.0) < 4 * fit.b_noise_sd and fit.b_noise_sd < 0.25 * 700.0


def test_band_grows_with_extrapolation_and_contains_the_mean():
    truth = McCandlishCurve(10.0, 1000.0)
    rng = np.random.default_rng(1)
    b = np.array(BATCHES[:5], dtype=float)
    fit = fit_mccandlish(b, [truth.epochs(x) * (1 + 0.05 * rng.standard_normal()) for x in b])
    lo1, hi1 = fit.epochs_band(256)
    lo2, hi2 = fit.epochs_band(65536)
    assert lo1 <= fit.epochs(256) <= hi1
    assert (hi2 - lo2) / fit.epochs(65536) > (hi1 - lo1) / fit.epochs(256)
    assert any("extrapolated" in n for n in fit.notes())


def test_steps_and_epochs_forms_agree():
    c = McCandlishCurve(e_min=4.0, b_noise=1000.0)
    n = 50_000
    s_min = c.e_min * n / c.b_noise
    for b in (10, 1000, 100_000):
        assert c.steps(b, n) == pytest.approx(s_min * (1 + c.b_noise / b))


def test_table_interpolates_log_log_and_round_trips():
    t = TableCurve((100.0, 1000.0), (2.0, 20.0), (0.2, 2.0))
    assert t.epochs(math.sqrt(100 * 1000)) == pytest.approx(math.sqrt(2 * 20))
    assert t.epochs(10) == pytest.approx(2.0)  # flat below the smallest measured batch
    assert t.epochs(10_000) == pytest.approx(200.0)  # last log-log slope continued
    assert curve_from_dict(t.to_dict()) == t
    c = McCandlishCurve(3.0, 500.0, ((0.1, 0.0), (0.0, 25.0)), batch_range=(16.0, 1024.0))
    assert curve_from_dict(c.to_dict()) == c


def test_bad_inputs_are_user_errors():
    with pytest.raises(UserError):
        fit_mccandlish([64, 64], [1.0, 2.0])
    with pytest.raises(UserError):
        fit_mccandlish([64, 128], [1.0, -2.0])
    with pytest.raises(UserError):
        curve_from_dict({"kind": "spline"})
    with pytest.raises(UserError):
        McCandlishCurve(0.0, 10.0)
