"""benchmarks/gpu_check.py --cpu-smoke: the GPU check's whole code path on CPU with tiny models, so the
script a short GPU window depends on cannot rot between windows."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(120)
def test_cpu_smoke_runs_every_step_of_the_check(tmp_path, capsys):
    gc = _script()
    out = tmp_path / "gpu_check.json"
    assert gc.main(["--cpu-smoke", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("estimated run time:")  # the estimate comes before any work
    res = json.loads(out.read_text())
    assert res["mode"] == "cpu-smoke" and res["environment"]["torch"]
    # the device profile: every op kind of both models timed, into a calibration the plans read
    prof = res["profile"]
    assert all(m["ops_timed"] > 0 for m in prof["models"].values()) and not prof["untimed"]
    cal = json.loads(Path(prof["path"]).read_text())
    assert {"conv2d", "batchnorm", "attention", "layernorm", "embedding", "linear"} <= {
        r["op"] for r in cal["ops"].values()}
    cells = res["cells"]
    assert len(cells) == len(gc.SMOKE.models) * 4
    for c in cells:
        if c["fmt"] == "channels_last" and "Transformer" in c["model"]:
            assert "not applicable: no 4-D activations" in c["notes"] and c["plain_s"] is None
            continue
        assert not any(n.startswith(("failed", "skipped")) for n in c["notes"]), c
        assert c["predicted_preset_s"] > 0 and c["predicted_calibrated_s"] > 0 and c["plain_s"] > 0
        # train has no channels-last: said, never filled in
        assert (c["train_s"] is None) == (c["fmt"] == "channels_last")
        if c["fmt"] == "channels_last":
            assert "hybridpar train: channels-last not supported" in c["notes"]
    # the calibrated predictions are priced on the measured device: its op times (fp32) and peaks
    cnn = {(c["dtype"], c["fmt"]): c for c in cells if c["spec"] == "small_cnn"}
    assert cnn["fp32", "nchw"]["predicted_calibrated_s"] != cnn["fp32", "nchw"]["predicted_preset_s"]
    assert any("roofline at the measured peaks" in n for n in cnn["bf16", "nchw"]["notes"])
    # ... the op table, not only the peaks: the measured cluster without the calibration prices otherwise
    peaks_only, _, _ = gc.predicted("small_cnn", str(out.with_suffix(".cluster.yaml")), 4, "fp32", None)
    assert cnn["fp32", "nchw"]["predicted_calibrated_s"] != pytest.approx(peaks_only, rel=1e-3)
    dev = yaml.safe_load(out.with_suffix(".cluster.yaml").read_text())["device"]
    assert dev["peak_flops"]["fp32"]["value"] == prof["peaks"]["fp32"]
    assert dev["mem_bw_Bps"]["source"].startswith("measured by benchmarks/gpu_check.py")
    kinds = res["op_kinds"]
    assert kinds["measured_s"]["conv2d"] > 0 and kinds["predicted_calibrated_s"]["conv2d"] > 0
    md = out.with_suffix(".md").read_text()
    assert "| small CNN | 4 | fp32 | nchw |" in md and "not supported" in md and "| conv2d |" in md
    assert res["summary"]["measured"] == len(cells) - 2


def test_readme_region_says_not_yet_run_without_a_gpu_result(tmp_path):
    gc = _script()
    assert gc.readme_region(tmp_path / "none.json").startswith("Not yet run")
    smoke = tmp_path / "smoke.json"
    smoke.write_text(json.dumps({"mode": "cpu-smoke"}))
    assert "not a GPU run" in gc.readme_region(smoke)  # a smoke run never stands in for the GPU's figures
