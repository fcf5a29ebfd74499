"""`hybridpar project` through the CLI with the real cost model, placer and planner."""

import json

import pytest

from hybridpar.cli.main import main


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDPAR_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def curve(tmp_path):
    p = tmp_path / "curve.json"
    p.write_text(json.dumps({"curve": {"kind": "mccandlish", "e_min": 5.0, "b_noise": 256.0, "b_noise_sd": 30.0},
                             "samples_per_epoch": 50000}))
    return p


def test_project_json_plot_and_budget(curve, tmp_path, capsys):
    png = tmp_path / "s.png"
    rc = main(["project", "--model", "small_cnn", "--cluster", "dgx1-v100", "--gpus", "1,2,8,16", "--placer", "dp",
               "--batch-per-gpu", "32", "--convergence", str(curve), "--cf-max-gpus", "0", "--plot", str(png),
               "--budget", "8", "--batch-options", "16,32", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    pts = out["points"]
    one = [p for p in pts if p["gpus"] == 1]
    assert [p["strategy"] for p in one] == ["DP"] and one[0]["speedup"] == pytest.approx(1.0)
    assert {p["strategy"] for p in pts if p["gpus"] == 16} >= {"DP", "DPxMP2", "DPxMP4", "DPxMP8"}
    dp = {p["gpus"]: p for p in pts if p["strategy"] == "DP"}
    assert dp[16]["global_batch"] == 16 * 32 and dp[16]["epochs"] > dp[1]["epochs"]
    assert set(out["best"]) == {"1", "2", "8", "16"}
    assert out["sensitivity"] and out["joint"]["budget_gpus"] == 8
    assert out["joint"]["dominant"] in out["joint"]["explanation"]
    assert any("channel/filter" in n for n in out["notes"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_project_table_output(curve, capsys):
    rc = main(["project", "--model", "small_cnn", "--gpus", "1,4", "--placer", "greedy", "--cf-max-gpus", "0",
               "--convergence", str(curve)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "projected speedup over 1 GPU" in text and "crossover" in text


@pytest.mark.parametrize("args, msg", [
    (["--model", "small_cnn"], "measure-convergence"),  # no built-in curve
    (["--model", "gnmt", "--gpus", "8,x"], "--gpus"),
    (["--model", "gnmt", "--placer", "magic"], "--placer"),
    (["--model", "gnmt", "--batch-per-gpu", "0"], "batch-per-gpu"),
    (["--model", "gnmt", "--convergence", "/nonexistent/c.json"], "not found"),
])
def test_project_bad_input_exits_2(args, msg, capsys):
    assert main(["project", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridpar: error:") and msg in err and "Traceback" not in err


@pytest.mark.slow
def test_gnmt_reproduces_the_papers_qualitative_result(capsys):
    rc = main(["project", "--model", "gnmt", "--cluster", "dgx1-v100", "--gpus", "1,64,512,1024,2048,4096",
               "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    dp = {p["gpus"]: p["speedup"] for p in out["points"] if p["strategy"] == "DP"}
    assert dp[4096] < 1.3 * dp[512]  # DP-only saturates
    assert out["crossover_gpus"] is not None and out["best"]["4096"].startswith("DPxMP")
    assert out["margin_at_scale"] > 0 and out["paper_margin"] == pytest.approx(0.08)


@pytest.mark.slow
def test_cnn_gets_channel_filter_points_from_the_planner(curve, capsys):
    rc = main(["project", "--model", "small_resnet", "--gpus", "1,8", "--placer", "dp", "--cf-max-gpus", "8",
               "--convergence", str(curve), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    cf = [p for p in out["points"] if p["family"] == "CF"]
    assert {p["strategy"] for p in cf} == {"CF2", "CF4", "CF8"}
    assert all(p["global_batch"] == 8 // p["mp"] * 32 for p in cf)


def test_time_chunks_what_if_is_labelled_and_off_by_default(curve, capsys):
    """By default DPxMP is priced as the MP runtime executes it (each LSTM whole); --time-chunks prices the
    placer's time-step wavefront and says it is a what-if. The wavefront can only help the placer."""
    base = ["project", "--model", "lstm2", "--gpus", "1,2,4", "--placer", "dp", "--convergence", str(curve),
            "--batch-per-gpu", "32", "--json"]
    assert main(base) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main([*base, "--time-chunks"]) == 0
    chunked = json.loads(capsys.readouterr().out)
    assert whole["time_chunks"] is False and chunked["time_chunks"] is True
    assert any("each recurrent layer whole" in n and "what-if" in n for n in whole["notes"])
    assert not any(n.startswith("WHAT-IF") for n in whole["notes"])
    assert any(n.startswith("WHAT-IF (--time-chunks)") for n in chunked["notes"])

    def mp2(out):
        return next(p for p in out["points"] if p["gpus"] == 2 and p["strategy"] == "DPxMP2")

    assert mp2(whole)["step_s"] != mp2(chunked)["step_s"]
