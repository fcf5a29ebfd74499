"""`hybridpar profile --model M --splits k` files its fake-world steps (hybridpar.profile.layout_steps) as
the subprocess measured them (a fresh process, as each rank is), under the model's resolved path and the
shape it ran at, with the layouts the runtime could not run."""

from __future__ import annotations

import pytest

from hybridpar.cluster.calibration import Calibration, LayoutStep
from hybridpar.profile.layout_steps import layouts_for
from hybridpar.profile.run import ProfileOptions, _layout_steps


def test_the_steps_are_filed_as_measured(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.py").write_text("")
    raw = {"skipped": {"filter=2": "UserError: no"}, "steps": [
        {"layout": "channel=2", "world_size": 2, "input_shape": [3, 8, 8], "step_s": 0.010, "collectives_s": 0.002,
         "redistributions_s": 0.001, "redistributions": 3, "rest_s": 0.007}]}
    opts = ProfileOptions(model="m.py:net", batch=8, splits=(2,))
    (st,), skipped = _layout_steps(opts, raw)
    # filed under the resolved path: looked up as ./m.py:net or by its absolute path alike
    assert st.model == f"{(tmp_path / 'm.py').resolve()}:net"
    assert st.key() == (st.model, 8, (3, 8, 8), 2, "channel=2")  # the shape it ran at (the model's own)
    cal = Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10, layout_steps=[st])
    assert cal.layout_step("./m.py:net", 8, (3, 8, 8), 2, "channel=2") == st
    assert cal.layout_step(str(tmp_path / "m.py") + ":net", 8, [3, 8, 8], 2, "channel=2") == st
    assert cal.layout_step("m.py:other", 8, (3, 8, 8), 2, "channel=2") is None
    assert skipped == {f"{st.model} | filter=2": "UserError: no"}
    assert st.rest_s == pytest.approx(0.007) and st.step_s == pytest.approx(0.010)
    assert _layout_steps(opts, None) == ([], {})


def test_a_new_profile_of_a_model_replaces_its_skipped_layouts():
    opts = ProfileOptions(model="zoo_net", batch=8, splits=(2,))
    old = Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10,
                      layout_steps_skipped={"zoo_net | filter=2": "old reason", "other | channel=2": "kept"})
    raw = {"skipped": {}, "steps": [
        {"layout": "filter=2", "world_size": 2, "step_s": 0.01, "collectives_s": 0.0,
         "redistributions_s": 0.0, "redistributions": 0, "rest_s": 0.01}]}
    steps, skipped = _layout_steps(opts, raw, old)
    assert [s.layout for s in steps] == ["filter=2"] and skipped == {"other | channel=2": "kept"}


def test_every_split_times_every_kind():
    assert layouts_for((1, 2, 4, 2)) == [("sample=2", 2), ("channel=2", 2), ("filter=2", 2),
                                         ("sample=4", 4), ("channel=4", 4), ("filter=4", 4)]


def test_hybridpar_profile_prints_the_steps_and_what_it_could_not_time(tmp_path, monkeypatch):
    from hybridpar.cli.commands.profile import _print
    from hybridpar.cli.output import console

    monkeypatch.chdir(tmp_path)
    model = f"{tmp_path.resolve()}/net.py:f"
    st = LayoutStep(model=model, batch=8, world_size=2, layout="sample=2", step_s=0.01, collectives_s=0.0,
                    redistributions_s=0.0, rest_s=0.01)
    cal = Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10, layout_steps=[st],
                      layout_steps_skipped={f"{model} | channel=2": "UserError: pool3d has no rule"})
    with console.capture() as got:
        _print(cal, tmp_path / "cal.json")
    text = got.get().split("models' steps on a fake world", 1)[1]  # (the file's path is printed above)
    assert "net.py:f" in text and str(tmp_path.resolve()) not in text  # shown relative to here
    assert "not timed on a fake world: net.py:f | channel=2" in text and "pool3d has no rule" in text
