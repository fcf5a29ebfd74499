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
    # ... in every dtype and memory format the cells run, each under its own key
    assert {"conv2d", "conv2d#bf16", "conv2d#cl", "conv2d#cl#bf16", "linear#bf16"} <= {
        r["op"] for r in cal["ops"].values()}
    cells = res["cells"]
    assert len(cells) == len(gc.SMOKE.models) * 4
    for c in cells:
        if c["fmt"] == "channels_last" and "Transformer" in c["model"]:
            assert "not applicable: no 4-D activations" in c["notes"] and c["plain_s"] is None
            continue
        assert not any(n.startswith(("failed", "skipped")) for n in c["notes"]), c
        assert c["predicted_preset_s"] > 0 and c["predicted_calibrated_s"] > 0 and c["plain_s"] > 0
        assert c["train_s"] > 0 and c["plain_host_s"] > 0  # train --channels-last in the channels-last cells
        # the preset has no channels-last op times: said, in the cell and the table
        assert ("preset: channels-last priced as NCHW" in c["notes"]) == (c["fmt"] == "channels_last")
    # the calibrated predictions are priced on the measured device: its op times (fp32) and peaks
    cnn = {(c["dtype"], c["fmt"]): c for c in cells if c["spec"] == "small_cnn"}
    assert cnn["fp32", "nchw"]["predicted_calibrated_s"] != cnn["fp32", "nchw"]["predicted_preset_s"]
    # bf16 and channels-last from their own records, not the fp32 NCHW ones
    for other in (("bf16", "nchw"), ("fp32", "channels_last")):
        assert cnn[other]["predicted_calibrated_s"] != pytest.approx(cnn["fp32", "nchw"]["predicted_calibrated_s"],
                                                                      rel=1e-3)
    # ... the op table, not only the peaks: the measured cluster without the calibration prices otherwise
    peaks_only, _, _ = gc.predicted("small_cnn", str(out.with_suffix(".cluster.yaml")), 4, "fp32", None)
    assert cnn["fp32", "nchw"]["predicted_calibrated_s"] != pytest.approx(peaks_only, rel=1e-3)
    dev = yaml.safe_load(out.with_suffix(".cluster.yaml").read_text())["device"]
    assert dev["peak_flops"]["fp32"]["value"] == prof["peaks"]["fp32"]
    assert dev["mem_bw_Bps"]["source"].startswith("measured by benchmarks/gpu_check.py")
    kinds = res["op_kinds"]
    assert kinds["measured_s"]["conv2d"] > 0 and kinds["predicted_calibrated_s"]["conv2d"] > 0
    md = out.with_suffix(".md").read_text()
    assert "| small CNN | 4 | fp32 | nchw |" in md and "(as NCHW)" in md and "| conv2d |" in md
    assert res["summary"]["measured"] == len(cells) - 2


def test_readme_region_says_not_yet_run_without_a_gpu_result(tmp_path):
    gc = _script()
    assert gc.readme_region(tmp_path / "none.json").startswith("Not yet run")
    smoke = tmp_path / "smoke.json"
    smoke.write_text(json.dumps({"mode": "cpu-smoke"}))
    assert "not a GPU run" in gc.readme_region(smoke)  # a smoke run never stands in for the GPU's figures


def test_summary_splits_the_cells_bound_by_the_hosts_launches():
    gc = _script()

    def cell(pred, plain, host):
        return gc.Cell("m", "s", 1, "fp32", "nchw", predicted_preset_s=pred, predicted_calibrated_s=pred,
                       plain_s=plain, plain_host_s=host)

    # GPU-bound: 10% under; host-bound (the host enqueues for 95% of the step): 50% under
    s = gc.summary([cell(0.09, 0.10, 0.03), cell(0.05, 0.10, 0.095)])
    assert s["gpu_bound"] == 1
    assert s["median_abs_err_calibrated_gpu_bound"] == pytest.approx(0.10)
    assert s["median_abs_err_calibrated"] == pytest.approx(0.30)
