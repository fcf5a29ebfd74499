"""Issue 15's defects, each as a regression test through `hybridpar train`: checkpoint directories that
belong to one run, the non-finite guard (exit 3), resume that says what it does, bounded work, and
one line + exit 2 before any rank starts for every bad input."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from hybridpar.cli.main import main
from hybridpar.procs import alive, children
from hybridpar.train import checkpoint as ckpt
from hybridpar.train import config as rc_mod

pytestmark = pytest.mark.timeout(300)

ONE = ["train", "--model", "small_cnn", "--strategy", "sample=1", "--nproc", "1", "--batch", "8"]
TWO = ["train", "--model", "small_cnn", "--strategy", "sample=2", "--nproc", "2", "--batch", "8"]
BIN = Path(sys.executable).parent


def _run(capsys, argv) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(code: int, err: str, needle: str, want: int = 2) -> None:
    assert code == want, err
    assert err.startswith("hybridpar: error:") and err.count("\n") == 1 and needle in err, err


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step-"))


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """Run A: 8 steps on one rank, a checkpoint every 2 steps (the newest two are kept: 6 and 8)."""
    root = tmp_path_factory.mktemp("a") / "ck"
    assert main([*ONE, "--steps", "8", "--checkpoint-dir", str(root), "--checkpoint-every", "2", "--json"]) == 0
    return root


@pytest.fixture
def ck(tmp_path, run_a):
    shutil.copytree(run_a, tmp_path / "ck")
    return tmp_path / "ck"


# -- 1. a checkpoint directory belongs to one run -----------------------------------------------------

@pytest.mark.slow
def test_another_runs_checkpoints_are_refused_then_overwritten_only_when_asked(ck, capsys):
    assert _steps(ck) == [6, 8]
    code, _, err = _run(capsys, [*ONE, "--lr", "0.05", "--steps", "4", "--checkpoint-dir", str(ck),
                                 "--checkpoint-every", "2"])
    _one_line(code, err, "holds another run's checkpoints (step-00000008 was made with lr=0.1, this run has lr=0.05)")
    assert _steps(ck) == [6, 8]  # untouched
    code, _, err = _run(capsys, [*ONE, "--lr", "0.05", "--steps", "4", "--checkpoint-dir", str(ck),
                                 "--checkpoint-every", "2", "--overwrite", "--json"])
    assert code == 0, err
    assert _steps(ck) == [2, 4]  # this run's own, newest two; the other run's 6 and 8 are gone
    info = ckpt.latest_checkpoint(ck)
    assert info.step == 4 and info.manifest["identity"]["lr"] == 0.05
    # The same run again without --resume would interleave with its own checkpoints: refused.
    code, _, err = _run(capsys, [*ONE, "--lr", "0.05", "--steps", "4", "--checkpoint-dir", str(ck)])
    _one_line(code, err, "already holds this run's checkpoints (newest step-00000004)")


def test_two_runs_cannot_share_a_directory(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time; from hybridpar.train.checkpoint import lock_directory; "
                               f"lock_directory({str(tmp_path / 'ck')!r}); print('locked', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, _, err = _run(capsys, [*ONE, "--steps", "2", "--checkpoint-dir", str(tmp_path / "ck")])
        _one_line(code, err, f"is in use by another run (pid {holder.pid})")
    finally:
        holder.kill()
        holder.wait()


# -- 2. never train on NaN ---------------------------------------------------------------------------

@pytest.mark.slow
def test_nonfinite_step_stops_with_exit_3_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    ck, save = tmp_path / "ck", tmp_path / "w.pt"
    # lr 1e30 overflows the weights at once; 1e6 relied on batch norm's one-pass variance breaking down
    # (exact statistics since fa97bae keep that run finite: loss ~5e5 at step 20)
    argv = [*TWO, "--steps", "20", "--lr", "1e30", "--checkpoint-dir", str(ck), "--checkpoint-every", "1",
            "--save", str(save), "--json"]
    code, out, err = _run(capsys, argv)
    assert code == 3 and out == "", (out, err)
    err = "".join(ln for ln in err.splitlines(True) if not ln.startswith("hybridpar: start-up: "))  # phases: info
    assert err.startswith("hybridpar: error: step ") and err.count("\n") == 1 and "nothing was saved" in err, err
    bad_step = int(err.split("step ")[1].split(":")[0])
    assert f"the last good checkpoint, step {bad_step}, is intact" in err
    assert not save.exists()
    info = ckpt.latest_checkpoint(ck)
    assert info.step == bad_step  # every step before the bad one was checkpointed; nothing after it
    assert all(bool(torch.isfinite(t).all()) for t in ckpt.full_model_state(info).values())
    # --resume restarts from that last good checkpoint (and stops at the same step again).
    code, _, err = _run(capsys, [*argv[:-1], "--resume"])
    assert code == 3, err
    assert f"resuming from step {bad_step}" in err and ckpt.latest_checkpoint(ck).step == bad_step


@pytest.mark.parametrize(("flag", "value", "needle"), [
    ("--lr", "nan", "--lr must be a finite number"), ("--lr", "inf", "--lr must be a finite number"),
    ("--momentum", "nan", "--momentum must be a finite number"),
    ("--weight-decay", "inf", "--weight-decay must be a finite number"),
    ("--seed", str(2**64), "--seed must be an integer from 0 to 2**63-1"),
    ("--seed", "-1", "--seed must be an integer"),
])
def test_nonfinite_or_out_of_range_numbers_exit_2(capsys, no_spawn, flag, value, needle):
    _one_line(*_run(capsys, [*TWO, flag, value])[::2], needle)


def test_nonfinite_inputs_and_init_weights_exit_2(tmp_path, capsys, no_spawn):
    x = torch.randn(16, 3, 32, 32)
    x[3, 0, 0, 0] = math.nan
    torch.save({"x": x, "y": torch.zeros(16, dtype=torch.long)}, tmp_path / "d.pt")
    _one_line(*_run(capsys, [*TWO, "--data", str(tmp_path / "d.pt")])[::2], "hold NaN or Inf")
    from hybridpar.graph.models import load_model

    state = load_model("small_cnn").module.state_dict()
    next(v for v in state.values() if v.is_floating_point()).fill_(math.inf)
    torch.save(state, tmp_path / "w.pt")
    _one_line(*_run(capsys, [*TWO, "--init-from", str(tmp_path / "w.pt")])[::2], "holds NaN or Inf")


# -- 3. resume says what it does -----------------------------------------------------------------------

def _corrupt(step_dir: Path) -> None:
    shard = step_dir / "rank-00000.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.mark.slow
def test_resume_names_skipped_checkpoints_and_where_it_starts(ck, capsys):
    _corrupt(ck / "step-00000008")
    code, out, err = _run(capsys, [*ONE, "--steps", "8", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
                                   "--resume", "--json"])
    assert code == 0, err
    assert "hybridpar: skipping checkpoint step-00000008: rank-00000.pt does not match its SHA-256" in err
    assert "hybridpar: resuming from step 6" in err
    assert [s["step"] for s in json.loads(out)["steps"]] == [6, 7]
    assert _steps(ck) == [6, 8] and ckpt.read_manifest(ck / "step-00000008")  # rewritten whole


def test_resume_over_only_damaged_checkpoints_is_exit_2_unless_if_any(ck, capsys, no_spawn):
    for d in ("step-00000006", "step-00000008"):
        _corrupt(ck / d)
    code, _, err = _run(capsys, [*ONE, "--steps", "8", "--checkpoint-dir", str(ck), "--resume"])
    _one_line(code, err, "--resume: every checkpoint in")
    assert "step-00000006" in err and "step-00000008" in err


@pytest.mark.slow
def test_resume_if_any_over_damaged_checkpoints_starts_at_0(ck, capsys):
    for d in ("step-00000006", "step-00000008"):
        _corrupt(ck / d)
    code, out, err = _run(capsys, [*ONE, "--steps", "2", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
                                   "--resume=if-any", "--json"])
    assert code == 0, err
    assert "skipping checkpoint step-00000006" in err and "starting at step 0" in err
    assert json.loads(out)["start_step"] == 0
    assert _steps(ck) == [2]  # the damaged ones are pruned once a good one exists


@pytest.mark.parametrize("steps", ["8", "4"])
def test_resuming_a_finished_run_is_nothing_to_do(ck, capsys, no_spawn, steps):
    code, out, err = _run(capsys, [*ONE, "--steps", steps, "--checkpoint-dir", str(ck), "--resume", "--json"])
    assert code == 0, err
    doc = json.loads(out)  # strict JSON: no NaN
    assert doc["steps"] == [] and doc["final_loss"] is None and "nothing to do" in doc["note"]
    assert "NaN" not in out


# -- 4. bounded work ----------------------------------------------------------------------------------

def test_a_run_that_cannot_fit_this_machine_is_refused_before_spawning(capsys, no_spawn, monkeypatch):
    monkeypatch.setattr(rc_mod, "available_memory", lambda: 8 * 2**30)
    code, _, err = _run(capsys, [*TWO, "--input-shape", "3,1024,1024"])
    _one_line(code, err, "this run needs about")
    assert "8.0 GiB available" in err


@pytest.mark.parametrize("shape", ["3,100000,100000", "3," + "9" * 30 + ",1"])
def test_huge_input_shapes_are_refused_before_anything_is_allocated(capsys, no_spawn, shape):
    t0 = time.perf_counter()
    _one_line(*_run(capsys, [*TWO, "--input-shape", shape])[::2], "--input-shape")
    assert time.perf_counter() - t0 < 30


def test_plan_world_size_must_fit_this_machine_without_nproc(tmp_path, capsys, no_spawn, monkeypatch):
    from hybridpar.plans import LayerLayout, Plan

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    Plan(model="small_cnn", world_size=64, dp=64, batch=128, default_layout=LayerLayout(sample=64)).save(
        tmp_path / "p.json")
    code, _, err = _run(capsys, ["train", "--plan", str(tmp_path / "p.json")])
    _one_line(code, err, "the plan is for 64 ranks but this machine has 2 CPU cores")


# -- 5. one line and exit 2 before any rank starts ------------------------------------------------------

MODELS = {
    "raises": "def net():\n    return Net()\nclass Net(nn.Module):\n"
              "    def forward(self, x):\n        raise ValueError('no forward for you')\n",
    "scalar": "def net():\n    return Net()\nclass Net(nn.Module):\n"
              "    def __init__(self):\n        super().__init__()\n        self.l = nn.Linear(4, 2)\n"
              "    def forward(self, x):\n        return self.l(x.flatten(1)).sum()\n",
    "bad_example": "def net():\n    return nn.Sequential(nn.Flatten(), nn.Linear(16, 2)), torch.randn(2, 5)\n",
    "exits": "import sys\ndef net():\n    sys.exit(0)\n",
}


@pytest.mark.parametrize(("kind", "needle"), [
    ("raises", "ValueError: no forward for you"), ("scalar", "forward returned a tensor of shape ()"),
    ("bad_example", "failed: RuntimeError"), ("exits", "called sys.exit(0)"),
])
def test_bad_model_files_exit_2(tmp_path, capsys, no_spawn, kind, needle):
    f = tmp_path / "m.py"
    f.write_text("import torch\nfrom torch import nn\n" + MODELS[kind])
    extra = [] if kind == "bad_example" else ["--input-shape", "1,2,2"]
    _one_line(*_run(capsys, ["train", "--model", f"{f}:net", *extra, "--strategy", "sample=1", "--nproc", "1",
                             "--batch", "4"])[::2], needle)


def test_tiny_input_shape_exit_2(capsys, no_spawn):
    _one_line(*_run(capsys, [*TWO, "--input-shape", "3,1,1"])[::2], "--model small_cnn: forward on one example")


@pytest.mark.parametrize(("target", "needle"), [("dir", "is a directory"), ("ro/w.pt", "not writable"),
                                                ("file/w.pt", "is not a directory"), ("/proc/w.pt", "not writable")])
def test_save_target_checked_before_training(tmp_path, capsys, no_spawn, target, needle):
    (tmp_path / "dir").mkdir()
    (tmp_path / "ro").mkdir(mode=0o500)
    (tmp_path / "file").write_text("")
    if target.startswith("ro") and os.geteuid() == 0:  # root writes anywhere: the check runs as nobody
        with _as_nobody() as base:
            _one_line(*_run(capsys, [*TWO, "--save", str(base / target)])[::2], needle)
        return
    _one_line(*_run(capsys, [*TWO, "--save", str(tmp_path / target)])[::2], needle)


@contextlib.contextmanager
def _as_nobody():
    """A folder with a mode-0500 `ro` inside, owned by nobody, with this process's effective uid set to
    nobody's while the block runs (root can seteuid back: its real and saved uids stay 0)."""
    nobody = 65534
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        (base / "ro").mkdir(mode=0o500)
        for p in (base, base / "ro"):
            os.chown(p, nobody, nobody)
        os.setegid(nobody)
        os.seteuid(nobody)
        try:
            yield base
        finally:
            os.seteuid(0)
            os.setegid(0)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- 6. files, disk full, signals -------------------------------------------------------------------

@pytest.mark.slow
def test_saved_weights_follow_the_umask(tmp_path, capsys):
    old = os.umask(0o022)
    try:
        assert main([*ONE, "--steps", "1", "--save", str(tmp_path / "w.pt"), "--json"]) == 0
    finally:
        os.umask(old)
    assert (tmp_path / "w.pt").stat().st_mode & 0o777 == 0o644


@pytest.mark.slow
def test_disk_full_during_a_checkpoint_is_one_error_and_leaves_no_tmp(tmp_path):
    from hybridpar.train.launch import spawn

    from .ckpt_worker import CRASH_ENV, train

    root = tmp_path / "ck"
    spawn(train, 2, str(root), "channel=2", 2, 2, 2, False, None)  # step-2 exists
    os.environ[CRASH_ENV] = "enospc"
    try:
        out = spawn(train, 2, str(root), "channel=2", 2, 4, 2, True, None)
    finally:
        del os.environ[CRASH_ENV]
    assert "no space left on the device" in out["error"] and "previous checkpoints are intact" in out["error"]
    assert _steps(root) == [2] and not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    ckpt.read_manifest(root / "step-00000002")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_launcher_alone_stops_every_rank(tmp_path, sig):
    ck = tmp_path / "ck"
    # SIGINT as an interactive user's: a suite started in the background (`make test &`) inherits SIGINT
    # ignored, and so would the launcher (POSIX: background jobs ignore it), which then never stops
    proc = subprocess.Popen([str(BIN / "hybridpar"), *TWO, "--steps", "100000", "--checkpoint-dir", str(ck),
                             "--checkpoint-every", "2", "--json"], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while ckpt.latest_checkpoint(ck) is None and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    ranks = [p for c in children(proc.pid) for p in [c, *children(c)]]
    assert ckpt.latest_checkpoint(ck) is not None and ranks, proc.stderr.read() if proc.poll() is not None else ""
    proc.send_signal(sig)  # the launcher only, not its process group
    proc.wait(timeout=60)
    assert proc.returncode == 130
    t0 = time.monotonic()
    while any(alive(p) for p in ranks) and time.monotonic() - t0 < 30:
        time.sleep(0.2)
    assert not any(alive(p) for p in ranks)
    ckpt.read_manifest(ckpt.latest_checkpoint(ck).path)  # the last complete checkpoint is intact


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "lars"])
def test_resume_is_bitwise_with_each_optimizer(tmp_path, capsys, monkeypatch, optimizer):
    """Optimizer state (AdamW's moments and step count, LARS's momentum) is checkpointed per piece and
    restored: a run killed after step 3 and resumed ends with the uninterrupted run's weights."""
    argv = ["train", "--model", "small_cnn", "--strategy", "channel=2", "--nproc", "2", "--batch", "8", "--steps",
            "5", "--optimizer", optimizer, "--lr", "0.01", "--momentum", "0.9", "--lr-schedule", "cosine",
            "--warmup-steps", "2", "--grad-clip", "1.0", "--json"]
    assert main([*argv, "--save", str(tmp_path / "ref.pt")]) == 0
    ck = tmp_path / "ck"
    monkeypatch.setenv("HYBRIDPAR_TEST_FAIL_RANK", "1")
    monkeypatch.setenv("HYBRIDPAR_TEST_FAIL_STEP", "3")
    assert main([*argv, "--checkpoint-dir", str(ck), "--checkpoint-every", "2"]) == 1
    monkeypatch.delenv("HYBRIDPAR_TEST_FAIL_RANK")
    capsys.readouterr()
    assert main([*argv, "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--resume",
                 "--save", str(tmp_path / "out.pt")]) == 0
    assert "resuming from step 2" in capsys.readouterr().err
    ref, out = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "out.pt")
    assert all(torch.equal(ref[k], out[k]) for k in ref)
