"""Issue 15's planning-command defects, each through the CLI: bounded work (a problem past the stated
limit is refused up front), non-finite and negative float options, absurd cluster figures, a factory
that calls sys.exit, and a channel/filter plan whose batch is smaller than its rank count."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from hybridpar.cli.main import main
from hybridpar.plans import load_plan

pytestmark = pytest.mark.timeout(120)

PRESET = Path(__file__).resolve().parents[2] / "src/hybridpar/cluster/presets/localhost.yaml"


def _one_line(capsys, argv, needle: str) -> str:
    t0 = time.perf_counter()
    code = main(argv)
    wall = time.perf_counter() - t0
    _, err = capsys.readouterr()
    assert code == 2, err
    assert err.startswith("hybridpar: error:") and err.count("\n") == 1 and needle in err, err
    assert wall < 30, f"took {wall:.1f} s"
    return err


def test_plan_past_the_size_limit_is_refused_up_front(capsys):
    err = _one_line(capsys, ["plan", "--model", "small_cnn", "--cluster", "dgx1-v100", "--gpus", "1000000",
                             "--batch", "1000000"], "too large to plan")
    assert "HYBRIDPAR_PLAN_MAX_S" in err


def test_absurd_gpu_count_is_refused_before_enumerating_layouts(capsys):
    _one_line(capsys, ["plan", "--model", "small_cnn", "--cluster", "dgx1-v100", "--gpus", str(10**15),
                       "--batch", "8"], "too large to plan")


def test_place_and_plan_obey_the_limit_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("HYBRIDPAR_PLAN_MAX_S", "1e-9")
    _one_line(capsys, ["place", "--model", "small_cnn", "--cluster", "dgx1-v100", "--gpus", "2"],
              "too large to plan")
    _one_line(capsys, ["plan", "--model", "small_cnn", "--cluster", "localhost", "--gpus", "2", "--batch", "8"],
              "too large to plan")
    monkeypatch.setenv("HYBRIDPAR_PLAN_MAX_S", "nan")
    _one_line(capsys, ["plan", "--model", "small_cnn", "--cluster", "localhost", "--gpus", "2", "--batch", "8"],
              "HYBRIDPAR_PLAN_MAX_S")


def test_project_past_the_size_limit_is_refused_up_front(capsys):
    _one_line(capsys, ["project", "--model", "resnet50", "--cluster", "dgx1-v100", "--gpus", "8,100000000",
                       "--no-cache"], "too large to plan")


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "small_cnn", "--gpus", "2", "--batch", "8", "--time-share", "nan"],
    ["plan", "--model", "small_cnn", "--gpus", "2", "--batch", "8", "--time-share", "inf"],
    ["plan", "--model", "small_cnn", "--gpus", "2", "--batch", "8", "--time-share", "-1"],
    ["place", "--model", "small_cnn", "--gpus", "2", "--time-limit", "nan"],
    ["place", "--model", "small_cnn", "--gpus", "2", "--time-limit", "-inf"],
    ["project", "--model", "resnet50", "--placer-time-limit", "nan"],
    ["project", "--model", "resnet50", "--placer-time-limit", "0"],
])
def test_float_options_refuse_nan_inf_and_negatives(capsys, argv):
    _one_line(capsys, argv, argv[-2])


@pytest.mark.parametrize(("path", "value", "field"), [
    (("device", "peak_flops"), {"fp32": {"value": 1e-300, "source": "red team"}}, "device.peak_flops.fp32"),
    (("device", "mem_bw_Bps"), 1e30, "device.mem_bw_Bps"),
    (("device", "memory_bytes"), 10.0, "device.memory_bytes"),
    (("device", "memory_bytes"), 1e30, "device.memory_bytes"),
    (("intra", "link_latency_s"), 1e6, "intra.link_latency_s"),
])
def test_absurd_cluster_figures_name_the_field(capsys, tmp_path, path, value, field):
    c = yaml.safe_load(PRESET.read_text())
    c[path[0]][path[1]] = value
    f = tmp_path / "absurd.yaml"
    f.write_text(yaml.safe_dump(c))
    err = _one_line(capsys, ["plan", "--model", "small_cnn", "--cluster", str(f), "--gpus", "2", "--batch", "8"],
                    field)
    assert "physical bounds" in err


@pytest.mark.parametrize("body", [
    "import sys\n\ndef net():\n    sys.exit(0)\n",
    "import sys\nsys.exit(0)\n\ndef net():\n    pass\n",
])
def test_a_model_file_that_calls_sys_exit_is_an_error(capsys, tmp_path, body):
    f = tmp_path / "m.py"
    f.write_text(body)
    _one_line(capsys, ["plan", "--model", f"{f}:net", "--input-shape", "1,2,2", "--gpus", "2", "--batch", "8"],
              "sys.exit(0)")


def test_channel_filter_plan_with_a_batch_below_the_rank_count(capsys, tmp_path):
    out = tmp_path / "plan.json"
    code = main(["plan", "--model", "small_cnn", "--strategy", "channel=2,filter=2", "--gpus", "4", "--batch", "2",
                 "--out", str(out), "--json"])
    _, err = capsys.readouterr()
    assert code == 0, err
    plan = load_plan(out)
    assert (plan.world_size, plan.batch, plan.default_layout.sample) == (4, 2, 1)
    _one_line(capsys, ["plan", "--model", "small_cnn", "--strategy", "sample=4", "--gpus", "4", "--batch", "2"],
              "sample")
