"""`hybridpar plan` beside both baselines: data parallelism and FSDP + full recomputation (--json key
`fsdp_recompute`), and `--recompute auto|none|all`."""

from __future__ import annotations

import json

from hybridpar.cli.main import main
from hybridpar.plans import load_plan

ARGS = ["plan", "--model", "small_cnn", "--cluster", "lassen", "--gpus", "4", "--batch", "8"]


def test_plan_json_carries_the_fsdp_baseline(capsys):
    assert main([*ARGS, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    fsdp, dp = out["fsdp_recompute"], out["data_parallel"]
    assert fsdp is not None and out["fsdp_recompute_note"] == ""
    assert fsdp["step_time_s"] > 0 and 0 < fsdp["memory_bytes_per_device"] < dp["memory_bytes_per_device"]
    brk = out["fsdp_recompute_breakdown"]
    assert brk["zero"] == 3 and brk["recompute"] == "all" and brk["allgather_bytes"] > 0 and brk["recompute_s"] > 0
    speedup = out["speedup_vs_fsdp_recompute"]
    assert speedup == fsdp["step_time_s"] / out["predicted"]["step_time_s"]
    assert any(n.startswith("against the baselines: data parallelism") and "FSDP + full recomputation" in n
               for n in out["plan"]["notes"])


def test_plan_prints_both_baselines(capsys):
    assert main(ARGS) == 0
    text = capsys.readouterr().out
    assert "FSDP + recompute" in text and "speedup over data parallelism" in text
    assert "speedup over FSDP + full recomputation" in text


def test_recompute_all_plan_runs_through_train(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*ARGS, "--recompute", "all", "--out", str(out), "--json"]) == 0
    plan = load_plan(out)
    assert plan.recompute == "all" and plan.default_layout.g_size == 1
    assert '"recompute": "all"' in out.read_text()
    from hybridpar.train.config import run_config

    setup = run_config(plan=str(out), steps=1, gpus=4)  # no --recompute: the plan's choice
    assert setup.config.parallel.recompute == "all"
    plain = tmp_path / "plain.json"
    assert main([*ARGS, "--recompute", "none", "--out", str(plain), "--json"]) == 0
    assert "recompute" not in json.loads(plain.read_text())  # unset: old plans stay byte-identical
    assert run_config(plan=str(plain), steps=1, gpus=4).config.parallel.recompute == "none"


def test_recompute_refuses_an_unknown_choice(capsys):
    assert main([*ARGS, "--recompute", "some"]) == 2


def test_report_shows_both_baselines(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*ARGS, "--out", str(out), "--json"]) == 0
    from hybridpar.report import build_report

    html = build_report(load_plan(out)).html
    assert "against the baselines: data parallelism" in html and "FSDP + full recomputation" in html
