"""`hybridpar train --tensorboard DIR` and `--profile-steps A:B`, through the command line: the event
file holds every step's loss, the trace names aten ops, bad specs are one line and exit 2."""

from __future__ import annotations

import json
import sys

import pytest

from hybridpar.cli.main import main

BASE = ["train", "--model", "small_cnn", "--strategy", "sample=2", "--nproc", "2", "--batch", "8"]


def _scalars(logdir, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.slow
def test_tensorboard_and_profile_flags(tmp_path, capsys, monkeypatch):
    from hybridpar.cluster.calibration import Calibration, save_calibration

    monkeypatch.chdir(tmp_path)  # the profile's default folder, ./hybridpar-profile
    # mfu needs a measured CPU peak (the built-in default is an approximation): a calibration file's
    cal = Calibration(cpu_count=2, peak_flops_fp32=1e11, mem_bw_Bps=1e10)
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(save_calibration(cal, tmp_path / "calibration.json")))
    code = main([*BASE, "--steps", "4", "--tensorboard", str(tmp_path / "tb"), "--profile-steps", "1:3", "--json"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    losses = [s["loss"] for s in json.loads(cap.out)["steps"]]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    got = _scalars(tmp_path / "tb", "loss")
    assert [s for s, _ in got] == [0, 1, 2, 3]
    assert [v for _, v in got] == pytest.approx(losses, rel=1e-6)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"lr", "samples_per_s", "mfu", "comm_bytes/allreduce"} <= tags, tags
    trace = tmp_path / "hybridpar-profile" / "trace-rank0-steps-1-3.json"
    events = json.loads(trace.read_text())["traceEvents"]
    names = {str(e.get("name", "")) for e in events}
    assert any(n.startswith("aten::") for n in names)
    assert {"hybridpar step 1", "hybridpar step 2"} <= names and "hybridpar step 0" not in names
    assert "hybridpar step 3" not in names
    assert f"profiler trace of steps 1..2 (chrome trace) in {trace.relative_to(tmp_path)}" in cap.err


@pytest.mark.slow
def test_config_file_sets_them_into_the_checkpoint_dir(tmp_path, capsys):
    (tmp_path / "run.toml").write_text(f'[train]\nmodel = "small_cnn"\nstrategy = "sample=2"\nnproc = 2\n'
                                       f'batch = 8\nsteps = 3\ntensorboard = "{tmp_path / "tb"}"\n'
                                       f'profile-steps = "0:1"\ncheckpoint-dir = "{tmp_path / "ck"}"\n')
    code = main(["train", "--config", str(tmp_path / "run.toml"), "--json"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    assert [s for s, _ in _scalars(tmp_path / "tb", "loss")] == [0, 1, 2]
    names = {e.get("name") for e in json.loads((tmp_path / "ck" / "profile" / "trace-rank0-steps-0-1.json")
                                                .read_text())["traceEvents"]}
    assert any(str(n).startswith("aten::") for n in names)


@pytest.mark.parametrize(("args", "needle"), [
    (["--profile-steps", "3:3"], "--profile-steps must be A:B with integers 0 <= A < B, got '3:3'"),
    (["--profile-steps", "4:2"], "--profile-steps must be A:B"),
    (["--profile-steps", "-1:2"], "--profile-steps must be A:B"),
    (["--profile-steps", "1.5:3"], "--profile-steps must be A:B"),
    (["--profile-steps", "a:b"], "--profile-steps must be A:B"),
    (["--profile-steps", "2"], "--profile-steps must be A:B"),
    (["--profile-steps", "20:30"], "--profile-steps 20:30: the run has steps 0..9"),
    (["--profile-dir", "p"], "--profile-dir needs --profile-steps"),
    (["--tensorboard", "/proc/tb"], "--tensorboard /proc/tb: not writable"),
])
def test_bad_specs_exit_2_one_line(capsys, args, needle):
    assert main([*BASE, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_bad_spec_in_a_config_file_exits_2(tmp_path, capsys):
    (tmp_path / "run.toml").write_text('profile-steps = "5:1"\n')
    assert main([*BASE, "--config", str(tmp_path / "run.toml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--profile-steps must be A:B" in err, err


def test_tensorboard_missing_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    loaded = [m for m in sys.modules if m.startswith(("tensorboard", "torch.utils.tensorboard"))]
    for name in loaded:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    assert main([*BASE, "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tensorboard" in err and "pip install 'hybridpar[tensorboard]'" in err, err
    assert not (tmp_path / "tb").exists()
