"""`hybridpar profile` measures the runtime's own overhead once per machine: a second call into the same
calibration file keeps it, `--remeasure-overhead` measures it again.

The overhead measurement is the real one (`hybridpar.profile.runtime_overhead.runtime_overhead`, in its
subprocess on the fake process group), counted by a wrapper that calls it with one round of one repeat
so the test stays fast. The other phases of a profile (matmul peaks, gloo collectives in spawned
ranks, framework memory, the MP executor's overhead: ~25 s here even at their smallest) are not what
is tested and are replaced by fixed figures."""

from __future__ import annotations

import platform

import pytest
import torch

from hybridpar.cli.main import main
from hybridpar.cluster.calibration import Calibration, Measurement, RuntimeOverhead, load_calibration, save_calibration
from hybridpar.profile import executor, framework_memory, rank_skew, run, runtime_overhead, update
from hybridpar.profile.run import ProfileOptions, overhead_to_keep

ARGV = ["profile", "--model", "", "--ranks", "2", "--sizes", "4K,8K", "--repeats", "1", "--warmup", "0"]


@pytest.fixture
def measured(monkeypatch) -> list[dict]:
    """Every runtime-overhead measurement made (real, at one round of one repeat); other phases fixed."""
    calls: list[dict] = []
    real = runtime_overhead.runtime_overhead

    def counted(**_kw) -> dict:
        calls.append(real(repeats=1, rounds=1))
        return calls[-1]

    def collectives(world, sizes, kinds, groups, **_kw):
        times = [Measurement(median_s=1e-4 + n * 1e-9, p10_s=1e-4, p90_s=2e-4, repeats=1) for n in sizes]
        return {(k, g): times for k in kinds for g in groups}

    monkeypatch.setattr(runtime_overhead, "runtime_overhead", counted)
    monkeypatch.setattr(run, "device_figures", lambda **_kw: {"peak_flops_fp32": 1e10, "mem_bw_Bps": 1e9})
    monkeypatch.setattr(run, "measure_collectives", collectives)
    monkeypatch.setattr(framework_memory, "measure_framework_bytes", lambda world: 300 << 20)
    monkeypatch.setattr(executor, "mp_node_overhead_s", lambda: 1e-5)
    fit = {"call_s": 1e-4, "per_tensor_s": 1e-6, "per_element_s": 1e-9}
    monkeypatch.setattr(update, "measure_update", lambda **_kw: {"update": {"sgd": fit}, "guard": {"sgd": fit},
                                                                 "loss": fit})
    monkeypatch.setattr(rank_skew, "_one_launch", lambda ps, cycles, iters, timeout_s: ({2: 1.1}, 0.01))
    return calls


@pytest.mark.timeout(60)
def test_a_second_profile_keeps_the_overhead_and_the_flag_measures_it_again(tmp_path, measured, capsys):
    path = tmp_path / "cal.json"
    assert main([*ARGV, "--out", str(path)]) == 0  # a fresh file: measured
    assert len(measured) == 1
    first = load_calibration(path).runtime_overhead
    assert first is not None and first.layer_fwd_s == measured[0]["layer_s"][0]
    capsys.readouterr()

    assert main([*ARGV, "--out", str(path)]) == 0  # the same file again: kept as it is
    assert len(measured) == 1 and load_calibration(path).runtime_overhead == first
    assert "kept from the file" in capsys.readouterr().out

    assert main([*ARGV, "--out", str(path), "--remeasure-overhead", "--json"]) == 0
    assert len(measured) == 2
    again = load_calibration(path).runtime_overhead
    assert again.layer_fwd_s == measured[1]["layer_s"][0] and again.layer_bwd_s == measured[1]["layer_s"][1]


def _file_with_overhead(path, **fields) -> RuntimeOverhead:
    o = RuntimeOverhead(sample_node_fwd_s=1e-6, sample_node_bwd_s=2e-6, dtensor_node_fwd_s=3e-6,
                        dtensor_node_bwd_s=4e-6, layer_fwd_s=5e-5, layer_bwd_s=6e-5,
                        spatial_op_fwd_s=7e-5, spatial_op_bwd_s=8e-5, redistribute_s=fields.pop("redistribute_s", 9e-5))
    cal = Calibration(**{"cpu_count": 2, "peak_flops_fp32": 1e10, "mem_bw_Bps": 1e9, "hostname": platform.node(),
                         "torch_version": torch.__version__, "runtime_overhead": o, **fields})
    save_calibration(cal, path)
    return o


def test_the_overhead_is_kept_only_from_this_host_and_torch(tmp_path):
    """Measured again when the file came from another machine or torch, when it has none, with
    --no-merge (the file is replaced) and with --remeasure-overhead."""
    opts = ProfileOptions()
    assert overhead_to_keep(opts, tmp_path / "none.json") is None
    o = _file_with_overhead(tmp_path / "here.json")
    assert overhead_to_keep(opts, tmp_path / "here.json") == o
    assert overhead_to_keep(ProfileOptions(merge=False), tmp_path / "here.json") is None
    assert overhead_to_keep(ProfileOptions(remeasure_overhead=True), tmp_path / "here.json") is None
    _file_with_overhead(tmp_path / "there.json", hostname="another-host")
    assert overhead_to_keep(opts, tmp_path / "there.json") is None
    _file_with_overhead(tmp_path / "old.json", torch_version="1.0")
    assert overhead_to_keep(opts, tmp_path / "old.json") is None
    # measured before the redistributions were: measured again, all of it
    _file_with_overhead(tmp_path / "older.json", redistribute_s=None)
    assert overhead_to_keep(opts, tmp_path / "older.json") is None
    save_calibration(Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e9, hostname=platform.node(),
                                 torch_version=torch.__version__), tmp_path / "without.json")
    assert overhead_to_keep(opts, tmp_path / "without.json") is None
