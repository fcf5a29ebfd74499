"""`hybridpar profile --model M --splits k` files its fake-world steps (hybridpar.profile.layout_steps) at
a fresh process's pace, as it files the op table: the subprocess timing them is one draw of this VM's
per-process speed, and its reference iteration says which."""

from __future__ import annotations

import pytest

from hybridpar.cluster.calibration import ProcessDraw
from hybridpar.profile.layout_steps import layouts_for
from hybridpar.profile.run import ProfileOptions, _layout_steps


def test_the_steps_are_scaled_to_a_fresh_process():
    raw = {"reference_s": 0.02, "steps": [
        {"layout": "channel=2", "world_size": 2, "step_s": 0.010, "collectives_s": 0.002,
         "redistributions_s": 0.001, "redistributions": 3, "rest_s": 0.007}]}
    opts = ProfileOptions(model="m.py:net", batch=8, splits=(2,))
    (st,) = _layout_steps(opts, raw, ProcessDraw(here_s=0.03, fresh_s=0.015))
    assert st.key() == ("m.py:net", 8, None, 2, "channel=2")
    assert st.rest_s == pytest.approx(0.007 * 0.75) and st.step_s == pytest.approx(0.010 * 0.75)
    (unscaled,) = _layout_steps(opts, raw, None)
    assert unscaled.rest_s == pytest.approx(0.007)
    assert _layout_steps(opts, None, None) == []


def test_every_split_times_both_kinds():
    assert layouts_for((1, 2, 4, 2)) == [("channel=2", 2), ("filter=2", 2), ("channel=4", 4), ("filter=4", 4)]
