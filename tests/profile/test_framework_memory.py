"""The framework constant of the memory model: resident set of an initialised gloo rank holding no model.
`hybridpar profile` measuring and writing it: tests/profile/test_profile_run.py (one profile run serves
both)."""


from hybridpar.cluster.calibration import Calibration, load_calibration, save_calibration


def test_resident_bytes_sees_touched_memory():
    # in a fresh process: in the suite's own process (after ~440 tests) the 64 MiB once showed as less
    # than 48 MiB of growth (2026-11-30, one full run of three), the allocator's earlier state unknown
    import subprocess
    import sys

    code = ("import torch; from hybridpar.profile.framework_memory import resident_bytes as rb; "
            "b = rb(); t = torch.ones(64 << 18); print(rb() - b)")  # 64 MiB, written
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert int(out.stdout.strip().splitlines()[-1]) >= 48 << 20, out


def test_calibration_file_keeps_the_constant(tmp_path):
    cal = Calibration(cpu_count=2, peak_flops_fp32=1e9, mem_bw_Bps=1e9, framework_bytes=300 << 20)
    path = save_calibration(cal, tmp_path / "c.json")
    assert load_calibration(path).framework_bytes == 300 << 20
    old = Calibration(cpu_count=2, peak_flops_fp32=1e9, mem_bw_Bps=1e9)  # files written before the field
    assert load_calibration(save_calibration(old, tmp_path / "o.json")).framework_bytes is None
