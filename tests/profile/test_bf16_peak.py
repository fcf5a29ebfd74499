"""Issue 14's leftover: localhost's bf16 peak is measured by `hybridpar profile`, and a bf16 run's mfu
is held to it (never to the fp32 figure a CPU's matrix units outrun)."""

from __future__ import annotations

from hybridpar.cluster import load_cluster
from hybridpar.cluster.calibration import Calibration, load_calibration, save_calibration
from hybridpar.train.metrics import peak_flops


def test_bf16_peak_is_measured_and_used(tmp_path, monkeypatch):
    from hybridpar.profile.run import device_figures

    figures = device_figures(warmup=1, repeats=3)
    assert figures["peak_flops_bf16"] > 1e8 and figures["matmul_bf16"].median_s > 0
    path = save_calibration(Calibration(cpu_count=2, **figures), tmp_path / "cal.json")
    assert load_calibration(path).peak_flops_bf16 == figures["peak_flops_bf16"]
    dev = load_cluster("localhost", gpus=2, calibration=path).device
    assert dev.peak("bf16") == figures["peak_flops_bf16"] and dev.peak("fp32") == figures["peak_flops_fp32"]
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(path))
    # the better of the two rates: a CPU without native bf16 runs autocast steps above its bf16 matmul rate
    assert peak_flops("localhost", "bf16") == max(figures["peak_flops_bf16"], figures["peak_flops_fp32"])
    assert peak_flops("localhost", "fp32") == figures["peak_flops_fp32"]


def test_no_bf16_figure_leaves_mfu_out_on_a_cpu(tmp_path, monkeypatch):
    old = save_calibration(Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e9), tmp_path / "old.json")
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(old))  # a file written before the bf16 field
    assert peak_flops("localhost", "bf16") is None
    assert peak_flops("localhost", "fp32") == 1e10
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(tmp_path / "none.json"))  # no calibration at all
    assert peak_flops("localhost", "bf16") is None
    # nor against the built-in approximate fp32 figure (a step can outrun it: mfu > 1)
    assert peak_flops("localhost", "fp32") is None
    assert load_cluster("localhost").device.peak("fp32") == 1e10  # the planner still has its default
    # a GPU preset without a bf16 entry (V100) runs it at the fp32 rate
    assert peak_flops("dgx1-v100", "bf16") == load_cluster("dgx1-v100").device.peak("fp32")
    assert peak_flops("dgx-a100", "bf16") == load_cluster("dgx-a100").device.peak_flops["bf16"]
