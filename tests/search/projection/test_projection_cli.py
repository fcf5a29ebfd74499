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


def _mp2(out: dict) -> dict:
    return next(p for p in out["points"] if p["gpus"] == 2 and p["strategy"] == "DPxMP2")


def test_time_chunks_default_is_the_placers_choice_and_runs(curve, capsys):
    """By default DPxMP is priced as `train` runs the placer's plan: the shorter of whole recurrent layers
    and the time-step wavefront the MP runtime executes (no what-if label); --time-chunks 1 and
    --no-time-chunks give whole layers, a bare --time-chunks the placer's K."""
    base = ["project", "--model", "lstm2", "--gpus", "1,2,4", "--placer", "dp", "--convergence", str(curve),
            "--batch-per-gpu", "32", "--json"]
    runs = {}
    for name, extra in (("default", []), ("k1", ["--time-chunks", "1"]), ("whole", ["--no-time-chunks"]),
                        ("bare", ["--time-chunks"]), ("k4", ["--time-chunks", "4"])):
        assert main([*base, *extra]) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    assert runs["default"]["time_chunks"] is None and runs["k1"]["time_chunks"] == 1
    assert runs["whole"]["time_chunks"] == 1 and runs["bare"]["time_chunks"] == 4
    for out in runs.values():
        assert not any("what-if" in n.lower() for n in out["notes"])
    assert any("mp 2: whole recurrent layers" in n for n in runs["whole"]["notes"])
    assert any("mp 2: 4 time chunks" in n for n in runs["k4"]["notes"])
    step = {k: _mp2(v)["step_s"] for k, v in runs.items()}
    assert step["k1"] == step["whole"] and step["bare"] == step["k4"]
    # lstm2 at mp 2: the wavefront overlaps its two layers, so the placer chooses it
    assert step["k4"] < step["k1"]
    assert step["default"] == pytest.approx(step["k4"])
    assert any("mp 2: 4 time chunks" in n for n in runs["default"]["notes"])


def test_time_chunks_contradiction_exits_2(curve, capsys):
    args = ["--model", "lstm2", "--gpus", "1,2", "--convergence", str(curve), "--no-time-chunks", "--time-chunks", "4"]
    assert main(["project", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridpar: error:") and "contradicts" in err and "Traceback" not in err


def test_time_chunks_option_values():
    """None stays the placer's choice; 0 and 1 are whole layers; the old booleans keep their meaning."""
    from hybridpar.errors import UserError
    from hybridpar.search.placer.unroll import DEFAULT_TIME_CHUNKS
    from hybridpar.search.projection.costs import time_chunks_option

    assert time_chunks_option(None) is None and time_chunks_option(0) == time_chunks_option(1) == 1
    assert time_chunks_option(8) == 8 and time_chunks_option(False) == 1
    assert time_chunks_option(True) == DEFAULT_TIME_CHUNKS
    with pytest.raises(UserError, match="--time-chunks"):
        time_chunks_option(-1)


@pytest.mark.slow
def test_dpxmp_step_is_the_plans_pipelined_step():
    """DPxMP's step is the placer's step as `train` runs its plan, with the micro-batch pipeline the plan
    asks for (BigLSTM at 2 devices: the 1F1B pipeline is all of its MP speedup), not the unpipelined one."""
    from hybridpar.search.placer import place_model
    from hybridpar.search.placer.config import PROJECTION_OPTIMIZER
    from hybridpar.search.projection.costs import CostModelBackend

    costs = CostModelBackend("biglstm", "dgx1-v100", use_disk_cache=False)
    res = costs._place(2, 128)
    out = place_model(costs.graph(128), "dgx1-v100", 2, batch=128, time_limit_s=3.0, **PROJECTION_OPTIMIZER)
    assert res["micro_batches"] == out.plan.micro_batches > 1
    assert res["step_s"] == pytest.approx(out.step_time_s) and out.step_time_s < out.result.step_time_s
    costs.mp_step(2, 128)
    assert any("mp 2: " in n and f"{res['micro_batches']} micro-batches" in n for n in costs.notes)
