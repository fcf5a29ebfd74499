"""Issue 33's red-team list, items 9-15: each reproducer as a test (each failed before its fix)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hybridpar.cli.main import main
from hybridpar.errors import UserError
from hybridpar.search import graph_cache
from hybridpar.train import checkpoint as ckpt
from hybridpar.user_code import call_factory

from .test_red_team import IDENTITY, _fake_checkpoint

pytestmark = pytest.mark.timeout(300)


def _one_line(code: int, err: str, needle: str, want: int = 2) -> None:
    """Exit `want` with one error line holding `needle` (start-up phase reports aside)."""
    lines = [line for line in err.splitlines() if not line.startswith("hybridpar: start-up")]
    assert code == want, err
    assert len(lines) == 1 and lines[0].startswith("hybridpar: error:") and needle in lines[0], err


def _file(tmp_path: Path, name: str, body: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


# -- 9. loader workers die with their rank (and so with a killed launcher) ----------------------------

_RANK = """
import os, sys, time, torch
from hybridpar.train.data.loader import batches

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        print(os.getpid(), flush=True)
        time.sleep(120)  # a worker blocked in the user's __getitem__: torch's parent check never runs
        return torch.zeros(2), 0

next(batches(Slow(), 4, stop=4, workers=1))
"""


def test_a_loader_worker_dies_with_its_rank(tmp_path):
    script = _file(tmp_path, "rank.py", _RANK)
    rank = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        worker = int(rank.stdout.readline())  # the worker is inside __getitem__ now
        rank.send_signal(signal.SIGKILL)
        rank.wait(timeout=30)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = Path(f"/proc/{worker}").exists() and "Z" not in Path(f"/proc/{worker}/stat").read_text().split()[2]
        if alive:
            os.kill(worker, signal.SIGKILL)
        assert not alive, "the loader worker outlived its rank"
    finally:
        rank.kill()


# -- 10 and 12. user code: a time limit, and what it leaves behind cannot hold the launcher ----------

_FACTORIES = """
import os, threading, time, torch
def loop():
    while True:
        pass
def sleeper():
    time.sleep(3600)
def exit0():
    os._exit(0)
class Base(BaseException):
    pass
def base():
    raise Base("not an Exception")
def forker():
    if os.fork() == 0:
        time.sleep(3600)
        os._exit(0)
    return torch.nn.Linear(4, 2)
def printer():
    print("hello on stdout")
    return torch.nn.Linear(4, 2)
"""


@pytest.mark.parametrize("fn, needle", [
    ("loop", "did not finish within 2 s (HYBRIDPAR_USER_CODE_TIMEOUT_S)"),
    ("sleeper", "did not finish within 2 s (HYBRIDPAR_USER_CODE_TIMEOUT_S)"),
    ("exit0", "ended its process (exit status 0) instead of returning"),
    ("base", "raised Base: not an Exception"),
])
def test_user_code_is_time_limited_and_cannot_end_the_launcher(tmp_path, monkeypatch, fn, needle):
    monkeypatch.setenv("HYBRIDPAR_USER_CODE_TIMEOUT_S", "2")
    f = _file(tmp_path, "facts.py", _FACTORIES)
    start = time.monotonic()
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        call_factory(f"{f}:{fn}", "model", "model file")
    assert time.monotonic() - start < 30


def test_a_factorys_stray_process_is_killed_and_its_prints_go_to_stderr(tmp_path, capfd):
    f = _file(tmp_path, "facts.py", _FACTORIES)
    before = set(os.listdir("/proc"))
    net = call_factory(f"{f}:forker", "model", "model file")
    assert isinstance(net, torch.nn.Linear)
    out, err = capfd.readouterr()
    assert "left 1 process(es) running; killed them" in err
    time.sleep(0.2)
    strays = [p for p in set(os.listdir("/proc")) - before if p.isdigit() and _is_sleeper(p)]
    assert not strays
    call_factory(f"{f}:printer", "model", "model file")
    out, err = capfd.readouterr()
    assert out == "" and "hello on stdout" in err


def _is_sleeper(pid: str) -> bool:
    try:
        return os.getppid() == int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return False


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "soon"])
def test_a_bad_user_code_time_limit_is_one_line(tmp_path, monkeypatch, value):
    monkeypatch.setenv("HYBRIDPAR_USER_CODE_TIMEOUT_S", value)
    f = _file(tmp_path, "facts.py", _FACTORIES)
    with pytest.raises(UserError, match="HYBRIDPAR_USER_CODE_TIMEOUT_S="):
        call_factory(f"{f}:printer", "model", "model file")


def test_a_thread_left_running_does_not_hold_the_command_line(tmp_path):
    f = _file(tmp_path, "thr.py", """
        import threading, time, torch
        def make():
            threading.Thread(target=time.sleep, args=(3600,)).start()
            return torch.nn.Linear(4, 2), torch.zeros(1, 4)
        """)
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "hybridpar.cli.main", "inspect", "--model", f"{f}:make"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-600:]
    assert time.monotonic() - start < 100


# -- 11. plan, place and inspect never allocate the example input ------------------------------------

_HUGE = ["--input-shape", "3,600000,600000"]  # 4.3 TB of float32 at batch 1: never allocatable


@pytest.mark.parametrize("cmd, refusal", [(["inspect", "--model", "small_cnn", *_HUGE], None),
                                          (["place", "--model", "small_cnn", "--gpus", "2", *_HUGE], "alone needs")])
def test_inspect_and_place_take_a_huge_input_shape_on_meta(capsys, cmd, refusal):
    code = main([*cmd, "--json"])
    out, err = capsys.readouterr()
    if refusal:  # priced from shapes, then refused for what it is: no device holds it
        _one_line(code, err, refusal)
    else:
        assert code == 0, err
        json.loads(out)


def test_load_model_on_meta_makes_meta_inputs(tmp_path):
    from hybridpar.graph.models import load_model

    zoo = load_model("small_cnn", batch=1, input_shape=(3, 60000, 60000), device="meta")
    assert all(x.is_meta for x in zoo.example_inputs)
    f = _file(tmp_path, "m.py", "import torch\ndef make():\n    return torch.nn.Flatten()\n")
    user = load_model(f"{f}:make", batch=1, input_shape=(3, 60000, 60000), device="meta")
    assert user.example_inputs[0].is_meta and tuple(user.example_inputs[0].shape) == (1, 3, 60000, 60000)


def test_the_graph_cache_traces_on_meta(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDPAR_CACHE", str(tmp_path))
    calls = []
    from hybridpar.graph import models

    real = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: calls.append(k.get("device")) or real(*a, **k))
    graph, shape = graph_cache.traced_graph("small_cnn", (3, 60000, 60000))
    assert calls == ["meta"] and shape == (3, 60000, 60000) and graph.nodes


# -- 13. bounded reads of every input file ------------------------------------------------------------

@pytest.fixture
def fifo(tmp_path):
    p = tmp_path / "fifo"
    os.mkfifo(p)
    return p


def _inputs(bad: str) -> list[tuple[list[str], dict, str]]:
    return [(["train", "--plan", bad], {}, "plan"),
            (["train", "--config", bad, "--model", "small_cnn"], {}, "--config"),
            (["report", "--plan", bad], {}, "plan"),
            (["plan", "--model", "small_cnn", "--gpus", "2", "--cluster", bad], {}, "cluster file"),
            (["plan", "--model", "small_cnn", "--gpus", "2"], {"HYBRIDPAR_CALIBRATION": bad}, "calibration file")]


@pytest.mark.parametrize("which", range(5))
@pytest.mark.parametrize("kind", ["fifo", "device", "oversized"])
def test_input_files_are_regular_and_bounded(tmp_path, capsys, monkeypatch, no_spawn, fifo, which, kind):
    if kind == "fifo":
        bad, needle = str(fifo), "is a FIFO; only regular files are read"
    elif kind == "device":
        bad, needle = "/dev/zero", "is a device; only regular files are read"
    else:
        big = tmp_path / "big.json"
        big.write_text(json.dumps({"pad": "x" * 5000}))
        monkeypatch.setenv("HYBRIDPAR_MAX_INPUT_BYTES", "4096")
        bad, needle = str(big), "over the 4096-byte limit (HYBRIDPAR_MAX_INPUT_BYTES)"
    argv, env, what = _inputs(bad)[which]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code = main(argv)
    _one_line(code, capsys.readouterr().err, f"{what} {bad} {needle}" if kind != "oversized" else needle)


# -- 14. tracebacks that become one line --------------------------------------------------------------

_ONE = ["train", "--strategy", "sample=1", "--nproc", "1", "--batch", "4", "--steps", "1", "--input-shape", "4"]


@pytest.mark.parametrize("body, needle", [
    ("import torch\ndef make():\n    return torch.nn.Flatten()\n", "has no trainable parameters"),
    ("import torch\nclass M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
     "        self.l = torch.nn.Linear(4, 3)\n    def forward(self, x):\n        return self.l(x).long()\n"
     "def make():\n    return M()\n", "forward returned torch.int64 logits"),
])
def test_a_model_that_cannot_train_is_refused_before_start(tmp_path, capsys, no_spawn, body, needle):
    f = _file(tmp_path, "m.py", body)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYBRIDPAR_USER_CODE_TIMEOUT_S", "0")  # no trial child (no_spawn forbids the fork)
        code = main([*_ONE, "--model", f"{f}:make"])
    _one_line(code, capsys.readouterr().err, needle)


# -- 15. trust boundaries: plans and caches are data -------------------------------------------------

def test_a_plan_never_runs_the_model_file_it_names(tmp_path, capsys, no_spawn):
    from .conftest import plan_dict

    marker = tmp_path / "ran"
    f = _file(tmp_path, "evil.py", f"open({str(marker)!r}, 'w').close()\nimport torch\n"
                                   "def make():\n    return torch.nn.Linear(4, 2)\n")
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps(plan_dict(model=f"{f}:make", world_size=1, dp=1, batch=4, default_layout={"sample": 1},
                                         layers={}, predicted=None)))
    code = main(["train", "--plan", str(plan), "--steps", "1"])
    _one_line(code, capsys.readouterr().err, "names the model file")
    assert not marker.exists()


class _Planted:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_planted_in_the_cache_does_not_run(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDPAR_CACHE", str(tmp_path / "cache"))
    marker = tmp_path / "ran"
    entry = graph_cache.cache_dir() / f"{graph_cache._key('small_cnn', None)}.pkl"
    entry.parent.mkdir(parents=True)
    entry.write_bytes(pickle.dumps((_Planted(str(marker)), None)))
    graph, _shape = graph_cache.traced_graph("small_cnn", None)  # refused, traced again
    assert not marker.exists()
    assert graph.nodes
    again, _ = graph_cache.traced_graph("small_cnn", None)  # the re-traced entry is read back
    assert again == graph


def test_a_symlinked_step_directory_is_ignored_on_resume(tmp_path):
    root = tmp_path / "ck"
    _fake_checkpoint(root, 2)
    elsewhere = _fake_checkpoint(tmp_path / "other", 4)  # this run's, but outside the directory
    (root / "step-00000004").symlink_to(elsewhere)
    (root / "step-00000006").symlink_to(tmp_path / "missing")
    (root / "step-00000008").symlink_to(root / "step-00000008")  # a loop
    found = ckpt.check_checkpoint_dir(root, IDENTITY, "yes")
    assert found.resume_from.step == 2 and found.resume_from.path == root / "step-00000002"
    assert any("ignoring step-00000004: a symlink" in n for n in found.notes), found.notes
    assert ckpt.latest_checkpoint(root).step == 2


@pytest.mark.parametrize("toml, needle", [
    ("steps = true\n", "steps: expected integer, got the boolean true"),
    ("steps = [1, 2]\n", "steps: expected one integer value, got a TOML array"),
    ("steps = 1979-05-27\n", "steps: expected one integer value, got a TOML date/time"),
    ("lr = 1979-05-27T07:32:00Z\n", "lr: expected one float value, got a TOML date/time"),
])
def test_toml_values_a_flag_cannot_take_are_one_line(tmp_path, capsys, no_spawn, toml, needle):
    cfg = tmp_path / "run.toml"
    cfg.write_text(toml)
    code = main(["train", "--model", "small_cnn", "--strategy", "sample=1", "--nproc", "1", "--config", str(cfg)])
    _one_line(code, capsys.readouterr().err, needle)


@pytest.mark.parametrize("value", ["inf", "1e-9", "nan", "soon", "-5"])
def test_a_bad_collective_timeout_is_refused_before_start(capsys, monkeypatch, no_spawn, value):
    monkeypatch.setenv("HYBRIDPAR_COLLECTIVE_TIMEOUT_S", value)
    code = main(["train", "--model", "small_cnn", "--strategy", "sample=1", "--nproc", "1", "--steps", "1"])
    _one_line(code, capsys.readouterr().err, f"HYBRIDPAR_COLLECTIVE_TIMEOUT_S={value!r}: expected seconds")


_LENGTHS = """
import torch
class D(torch.utils.data.Dataset):
    def __len__(self):
        return -3
    def __getitem__(self, i):
        return torch.zeros(3, 32, 32), 0
class R(D):
    def __len__(self):
        raise RuntimeError("no len")
class H(D):
    def __len__(self):
        return 10**12
def neg():
    return D()
def raises():
    return R()
def huge():
    return H()
"""


@pytest.mark.parametrize("fn, needle", [("neg", "len() of the data set raised ValueError"),
                                        ("raises", "len() of the data set raised RuntimeError: no len"),
                                        ("huge", "the data set has 1,000,000,000,000 samples, over")])
def test_a_data_sets_length_is_checked_before_start(tmp_path, capsys, no_spawn, fn, needle):
    f = _file(tmp_path, "lengths.py", _LENGTHS)
    code = main(["train", "--model", "small_cnn", "--strategy", "sample=1", "--nproc", "1", "--batch", "4",
                 "--steps", "1", "--data", f"{f}:{fn}", "--workers", "0"])
    _one_line(code, capsys.readouterr().err, needle)
