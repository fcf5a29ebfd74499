"""Hybrid D x M on ranks that share cores: a busy rank is stretched by its expected share of a core
given the others' busy fractions (search/placer/hybrid_step._busy_share), not by ranks/cores."""

from __future__ import annotations

import pytest

from hybridpar.search.placer.hybrid_step import _expected_stretch, hybrid_step_time, price_placement

PLACEMENT = {"block1.b3": 1, "block2": 1}  # inception_mini: a branch and the second block on device 1


def test_expected_stretch_is_the_core_share_of_a_busy_rank():
    assert _expected_stretch(0, [1.0, 1.0], 2, 2) == pytest.approx(2.0)  # all 4 busy on 2 cores: the old share
    assert _expected_stretch(0, [0.0, 0.0], 2, 2) == pytest.approx(1.0)  # alone: a core of its own
    # device 0's other replica always busy, device 1's two ranks never: 2 ranks on 2 cores
    assert _expected_stretch(0, [1.0, 0.0], 2, 2) == pytest.approx(1.0)
    # one other rank busy half the time on 1 core: 0.5 x 1 + 0.5 x 2
    assert _expected_stretch(0, [0.5], 2, 1) == pytest.approx(1.5)


def test_hybrid_on_shared_cores_is_priced_below_every_rank_busy(monkeypatch, tmp_path):
    monkeypatch.setattr("hybridpar.cluster.localhost.physical_cores", lambda: 2)
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(tmp_path / "none.json"))  # no measured pace: share = ranks/cores
    uniform = price_placement("inception_mini", "localhost", 2, 16, PLACEMENT, world=4, optimizer="sgd")
    h = hybrid_step_time("inception_mini", "localhost", 2, 2, 16, placement=PLACEMENT, optimizer="sgd")
    assert uniform.problem.time_share == pytest.approx(2.0)  # uncalibrated: ranks / cores
    assert h.mp_step_s < uniform.step_time_s  # an MP rank idles in its receives: fewer than 4 compete
    alone = price_placement("inception_mini", "localhost", 2, 16, PLACEMENT, world=2, optimizer="sgd")
    assert h.mp_step_s > alone.step_time_s  # but more than 2 do


def test_no_change_where_every_rank_has_a_device():
    got = hybrid_step_time("inception_mini", "dgx1-v100", 2, 2, 16, placement=PLACEMENT, optimizer="sgd")
    ref = price_placement("inception_mini", "dgx1-v100", 2, 16, PLACEMENT, world=4, optimizer="sgd")
    assert got.mp_step_s == pytest.approx(ref.step_time_s)
