import json

import pytest

from hybridpar.cli.main import main
from hybridpar.cluster import load_cluster
from hybridpar.cluster.calibration import (
    Calibration,
    GlooFit,
    Measurement,
    load_calibration,
    save_calibration,
)
from hybridpar.errors import UserError
from hybridpar.profile.gloo import fit_alpha_beta


def _m(s):
    return Measurement(median_s=s, p10_s=s * 0.9, p90_s=s * 1.2, repeats=5)


def test_fit_recovers_alpha_beta_of_a_ring():
    p, alpha, beta = 4, 2e-4, 1e-9
    sizes = [4096, 65536, 1 << 20, 4 << 20]
    times = [_m(2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta) for n in sizes]
    fit = fit_alpha_beta(p, sizes, times)
    assert fit.alpha_s == pytest.approx(alpha) and fit.beta_s_per_byte == pytest.approx(beta)
    assert fit.max_rel_residual < 1e-9


def _cal(**kw) -> Calibration:
    fit = GlooFit(world_size=2, intercept_s=4e-4, slope_s_per_byte=2e-9, alpha_s=2e-4, beta_s_per_byte=2e-9,
                  sizes_bytes=[1, 2], times=[_m(1e-3), _m(2e-3)], max_rel_residual=0.1)
    return Calibration(cpu_count=2, peak_flops_fp32=3e10, mem_bw_Bps=6e9, gloo={2: fit}, **kw)



def test_a_flat_allreduce_fit_keeps_its_latency_and_bounds_the_bandwidth(tmp_path):
    """Noise over a few sizes can leave the fit no slope (its b is kept >= 0): the measured latency is
    still used (a profile test once saw the preset's instead), and the per-byte cost is bounded by the
    largest measured allreduce's time put all on its bytes."""
    flat = GlooFit(world_size=2, intercept_s=1.5e-3, slope_s_per_byte=0.0, alpha_s=7.5e-4, beta_s_per_byte=0.0,
                   sizes_bytes=[16 << 10, 256 << 10, 2 << 20], times=[_m(1.6e-3), _m(1.4e-3), _m(1.5e-3)],
                   max_rel_residual=0.1)
    path = save_calibration(Calibration(cpu_count=2, peak_flops_fp32=3e10, mem_bw_Bps=6e9, gloo={2: flat}),
                            tmp_path / "cal.json")
    c = load_cluster("localhost", gpus=2, calibration=path)
    if c.cores >= 2:
        assert c.intra.link_latency_s == pytest.approx(7.5e-4)
        assert 1 / c.intra.link_bw_Bps == pytest.approx(1.5e-3 / (2 << 20))  # p / (2 (p - 1)) = 1 at p = 2
        assert "bounded by the largest" in c.sources["intra.link_bw_Bps"]
        assert "fitted" in c.sources["intra.link_latency_s"]

def test_roundtrip_and_atomic_write(tmp_path):
    path = tmp_path / "sub" / "cal.json"
    save_calibration(_cal(), path)
    assert [p.name for p in path.parent.iterdir()] == ["cal.json"]  # no temporary left behind
    assert load_calibration(path) == _cal()


def test_localhost_reads_the_calibration(tmp_path, monkeypatch):
    path = save_calibration(_cal(), tmp_path / "cal.json")
    c = load_cluster("localhost", gpus=2, calibration=path)
    assert c.ranks_share_cores and c.cores >= 1 and c.num_devices == 2 and c.num_nodes == 1
    assert c.device.peak("fp32") == 3e10 and c.device.mem_bw_Bps == 6e9
    if c.cores >= 2:  # the calibration says 2 cores; on a 2+ core machine no stretch at 2 ranks
        assert c.intra.link_latency_s == pytest.approx(2e-4)
        assert c.intra.link_bw_Bps == pytest.approx(1 / 2e-9)
    assert "measured" in c.sources["device.peak_flops.fp32"]
    # Default path from the environment variable.
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(path))
    assert load_cluster("localhost", gpus=2).device.peak("fp32") == 3e10
    # 4 ranks on 2 calibrated cores: alpha/beta from the 2-rank fit, stretched by the oversubscription.
    c4 = load_cluster("localhost", gpus=4)
    assert c4.intra.link_latency_s == pytest.approx(2 * 2e-4)


def test_no_calibration_means_labelled_defaults(tmp_path):
    c = load_cluster("localhost", calibration=tmp_path / "missing.json")
    assert c.sources["device.peak_flops.fp32"].startswith("[approximation]")
    assert any("no calibration" in n for n in c.notes)


def test_malformed_calibration_is_a_user_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="unreadable"):
        load_calibration(bad)
    bad.write_text(json.dumps({"cpu_count": 2, "peak_flops_fp32": -1, "mem_bw_Bps": 1}))
    with pytest.raises(UserError, match="field peak_flops_fp32"):
        load_calibration(bad)
    with pytest.raises(UserError, match="not found"):
        load_calibration(tmp_path / "none.json", required=True)


@pytest.mark.parametrize("args, needle", [
    (["--ranks", "1"], "--ranks"),
    (["--sizes", "abc"], "--sizes"),
    (["--sizes", "64K"], "--sizes"),
    (["--batch", "0"], "--batch"),
    (["--model", "no_such_model"], "unknown model"),
])
def test_profile_bad_input_one_line_exit_2(tmp_path, capsys, args, needle):
    out = tmp_path / "cal.json"
    assert main(["profile", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err
    assert not out.exists()
