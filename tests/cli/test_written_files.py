"""Files the commands write are readable as the umask says (0644 under 022, 0664 under 002), not
mkstemp's 0600: plans, plots and reports are meant to be shared."""

from __future__ import annotations

import json
import os
import stat

import pytest

from hybridpar.cli.main import main


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664)])
def test_plan_plot_and_report_follow_the_umask(tmp_path, capsys, umask, mode):
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"curve": {"kind": "mccandlish", "e_min": 5.0, "b_noise": 256.0, "b_noise_sd": 30.0},
                                 "samples_per_epoch": 50000}))
    plan, plot, report = tmp_path / "plan.json", tmp_path / "proj.png", tmp_path / "r.html"
    old = os.umask(umask)
    try:
        assert main(["plan", "--model", "small_cnn", "--out", str(plan), "--json"]) == 0
        assert main(["project", "--model", "small_cnn", "--gpus", "1,2", "--placer", "greedy", "--mp", "2",
                     "--cf-max-gpus", "0", "--convergence", str(curve), "--plot", str(plot), "--json"]) == 0
        assert main(["report", "--plan", str(plan), "--out", str(report), "--json"]) == 0
    finally:
        os.umask(old)
    capsys.readouterr()
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in (plan, plot, report)} == \
        {p.name: mode for p in (plan, plot, report)}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind
