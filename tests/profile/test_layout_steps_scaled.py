"""`hybridpar profile --model M --splits k` files its fake-world steps (hybridpar.profile.layout_steps) at
a fresh process's pace, as it files the op table: the subprocess timing them is one draw of this VM's
per-process speed, and its reference iteration says which."""

from __future__ import annotations

import pytest

from hybridpar.cluster.calibration import Calibration, ProcessDraw
from hybridpar.profile.layout_steps import layouts_for
from hybridpar.profile.run import ProfileOptions, _layout_steps


def test_the_steps_are_scaled_to_a_fresh_process(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.py").write_text("")
    raw = {"reference_s": 0.02, "skipped": {"filter=2": "UserError: no"}, "steps": [
        {"layout": "channel=2", "world_size": 2, "step_s": 0.010, "collectives_s": 0.002,
         "redistributions_s": 0.001, "redistributions": 3, "rest_s": 0.007}]}
    opts = ProfileOptions(model="m.py:net", batch=8, splits=(2,))
    (st,), skipped = _layout_steps(opts, raw, ProcessDraw(here_s=0.03, fresh_s=0.015))
    # filed under the resolved path: looked up as ./m.py:net or by its absolute path alike
    assert st.model == f"{(tmp_path / 'm.py').resolve()}:net"
    assert st.key() == (st.model, 8, None, 2, "channel=2")
    cal = Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10, layout_steps=[st])
    assert cal.layout_step("./m.py:net", 8, None, 2, "channel=2") == st
    assert cal.layout_step(str(tmp_path / "m.py") + ":net", 8, None, 2, "channel=2") == st
    assert cal.layout_step("m.py:other", 8, None, 2, "channel=2") is None
    assert skipped == {f"{st.model} | filter=2": "UserError: no"}
    assert st.rest_s == pytest.approx(0.007 * 0.75) and st.step_s == pytest.approx(0.010 * 0.75)
    (unscaled,), _ = _layout_steps(opts, raw, None)
    assert unscaled.rest_s == pytest.approx(0.007)
    assert _layout_steps(opts, None, None) == ([], {})


def test_a_new_profile_of_a_model_replaces_its_skipped_layouts():
    opts = ProfileOptions(model="zoo_net", batch=8, splits=(2,))
    old = Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10,
                      layout_steps_skipped={"zoo_net | filter=2": "old reason", "other | channel=2": "kept"})
    raw = {"reference_s": 0.0, "skipped": {}, "steps": [
        {"layout": "filter=2", "world_size": 2, "step_s": 0.01, "collectives_s": 0.0,
         "redistributions_s": 0.0, "redistributions": 0, "rest_s": 0.01}]}
    steps, skipped = _layout_steps(opts, raw, None, old)
    assert [s.layout for s in steps] == ["filter=2"] and skipped == {"other | channel=2": "kept"}


def test_every_split_times_every_kind():
    assert layouts_for((1, 2, 4, 2)) == [("sample=2", 2), ("channel=2", 2), ("filter=2", 2),
                                         ("sample=4", 4), ("channel=4", 4), ("filter=4", 4)]
