"""Red team, re-run as a script (not timed): bad inputs thrown at the command line, faults injected into
real training runs. Reports how many of each were handled as promised (docs: README, "Hardening").

Bad inputs: each must end with exit 2 and exactly one line on stderr (`hybridpar: error: ...`, no
traceback), within a time limit, without starting a rank (`train`: the spawner is replaced by a
tripwire) and without leaving files behind. `train` inputs run in this process through
`hybridpar.cli.main.main` (fast); other commands run as subprocesses with a time and memory limit
(RLIMIT_AS), so a runaway one is counted as a failure instead of eating the machine.

Faults: `hybridpar train --model small_cnn --strategy sample=2 --nproc 2 --batch 16` runs of 12 steps
with a checkpoint every 2, interrupted in every way below; each must leave a complete checkpoint
behind, and a `--resume` must then reach the uninterrupted run's final weights bit for bit ("survived,
nothing lost"). NaN runs must stop with exit 3 and keep only finite checkpoints.

    python benchmarks/bench_hardening.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridpar.procs import alive, descendants

BIN = Path(sys.executable).parent / "hybridpar"
T = ["train", "--model", "small_cnn", "--strategy", "sample=2", "--nproc", "2", "--batch", "16"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDPAR_COLLECTIVE_TIMEOUT_S": "60"}


@dataclass
class Outcome:
    name: str
    ok: bool
    detail: str


# -- bad inputs ------------------------------------------------------------------------------------

class _Spawned(Exception):
    pass


def _tripwire(*_a, **_k):
    raise _Spawned("a rank was started for bad input")


def _model_file(d: Path, name: str, body: str) -> str:
    f = d / f"{name}.py"
    f.write_text("import sys\nimport torch\nfrom torch import nn\n" + body)
    return f"{f}:net"


def train_inputs(d: Path) -> list[tuple[str, list[str]]]:
    """(name, argv) of bad `train` inputs; files they need are written under d."""
    (d / "file").write_text("")
    (d / "adir").mkdir()
    x = torch.randn(32, 3, 32, 32)
    x[0, 0, 0, 0] = math.nan
    torch.save({"x": x, "y": torch.zeros(32, dtype=torch.long)}, d / "nan.pt")
    from hybridpar.graph.models import load_model

    state = load_model("small_cnn").module.state_dict()
    next(v for v in state.values() if v.is_floating_point()).fill_(math.nan)
    torch.save(state, d / "nan_w.pt")
    torch.save({"weight": torch.zeros(3)}, d / "wrong_w.pt")
    from hybridpar.plans import LayerLayout, Plan

    Plan(model="small_cnn", world_size=2, dp=2, batch=8, default_layout=LayerLayout(sample=2)).save(d / "p2.json")
    big = max(os.cpu_count() or 1, 2) * 32
    Plan(model="small_cnn", world_size=big, dp=big, batch=big * 2,
         default_layout=LayerLayout(sample=big)).save(d / "pbig.json")
    (d / "bad_plan.json").write_text('{"schema_version": 1, "model": "small_cnn", "world_size": 2, "batch": NaN}')
    models = {
        "forward_raises": "class Net(nn.Module):\n    def forward(self, x):\n        raise ValueError('boom')\n"
                          "def net():\n    return Net()\n",
        "forward_scalar": "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                          "        self.l = nn.Linear(4, 2)\n    def forward(self, x):\n"
                          "        return self.l(x.flatten(1)).sum()\n"
                          "def net():\n    return Net()\n",
        "forward_tuple": "class Net(nn.Module):\n    def forward(self, x):\n        return (x, x)\n"
                         "def net():\n    return Net()\n",
        "bad_example": "def net():\n    return nn.Sequential(nn.Flatten(), nn.Linear(16, 2)), torch.randn(2, 5)\n",
        "factory_exit0": "def net():\n    sys.exit(0)\n",
        "factory_raises": "def net():\n    raise RuntimeError('no model today')\n",
        "import_error": "import not_a_module_anywhere\ndef net():\n    return nn.Linear(2, 2)\n",
        "not_a_module": "def net():\n    return 42\n",
    }
    inputs: list[tuple[str, list[str]]] = []
    for name, body in models.items():
        spec = _model_file(d, name, body)
        inputs.append((f"model file: {name}", ["train", "--model", spec, "--input-shape", "1,2,2", "--strategy",
                                               "sample=1", "--nproc", "1", "--batch", "4"]))
    for flag, values in {"--lr": ["nan", "inf", "-inf", "0", "-0.1", "1e400"], "--momentum": ["nan", "-1", "inf"],
                         "--weight-decay": ["inf", "nan", "-1"], "--seed": [str(2**64), "-1", str(10**30)],
                         "--steps": ["0", "-3"], "--batch": ["0", "-8", str(10**9)], "--nproc": ["0", "3"],
                         "--synthetic-size": ["0", "4"], "--epochs": ["0"], "--checkpoint-every": ["-1"],
                         "--micro-batches": ["2", "0"],
                         "--input-shape": ["3,1,1", "3,100000,100000", "3,0,32", "3,-1,32", "a,b",
                                           "1," + "9" * 30 + ",1"],
                         "--data": ["imagenet", str(d / "nan.pt"), str(d / "missing.pt"), "npy:" + str(d / "adir")],
                         "--init-from": [str(d / "nan_w.pt"), str(d / "wrong_w.pt"), str(d / "missing.pt")],
                         "--save": [str(d / "adir"), str(d / "file" / "w.pt"), "/proc/hybridpar-w.pt"],
                         "--strategy": ["sample=0", "channel=3", "mp=2,sample=2,channel=2", "foo=2", ""]}.items():
        for v in values:
            argv = [a for a in T if not (flag == "--strategy" and a in ("--strategy", "sample=2"))]
            inputs.append((f"train {flag} {v[:40]}", [*argv, f"{flag}={v}" if v.startswith("-") else flag, *(
                [] if v.startswith("-") else [v])]))
    inputs += [
        ("train --input-shape 3,1024,1024 x 100000 samples",
         [*T, "--input-shape", "3,1024,1024", "--synthetic-size", "100000"]),
        ("train --plan + disagreeing --batch", ["train", "--plan", str(d / "p2.json"), "--batch", "16"]),
        ("train --plan + disagreeing --nproc", ["train", "--plan", str(d / "p2.json"), "--nproc", "4"]),
        ("train --plan for more ranks than cores", ["train", "--plan", str(d / "pbig.json")]),
        ("train --plan NaN batch", ["train", "--plan", str(d / "bad_plan.json")]),
        ("train --plan missing", ["train", "--plan", str(d / "nope.json")]),
        ("train --strategy and --plan", [*T, "--plan", str(d / "p2.json")]),
        ("train neither --strategy nor --plan", ["train", "--model", "small_cnn"]),
        ("train --steps and --epochs", [*T, "--steps", "2", "--epochs", "1"]),
        ("train --resume without --checkpoint-dir", [*T, "--resume"]),
        ("train --overwrite without --checkpoint-dir", [*T, "--overwrite"]),
        ("train --checkpoint-dir is a file", [*T, "--checkpoint-dir", str(d / "file")]),
        ("train --resume=sometimes", [*T, "--checkpoint-dir", str(d / "ck0"), "--resume=sometimes"]),
    ]
    return inputs


def run_train_input(name: str, argv: list[str], d: Path) -> Outcome:
    from hybridpar.cli.main import main
    from hybridpar.train import launch

    before = set(d.rglob("*"))
    real, launch.spawn = launch.spawn, _tripwire
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except _Spawned:
        return Outcome(name, False, "started ranks")
    except BaseException as e:  # noqa: BLE001 - anything escaping main is a failure to report
        return Outcome(name, False, f"escaped: {type(e).__name__}: {e}"[:200])
    finally:
        launch.spawn = real
    wall = time.perf_counter() - t0
    return _judge(name, code, err.getvalue(), wall, set(d.rglob("*")) - before)


def _judge(name: str, code: int | None, err: str, wall: float, new_files: set) -> Outcome:
    lines = err.strip().splitlines()
    if code != 2:
        return Outcome(name, False, f"exit {code}: {err.strip()[-200:]}")
    if len(lines) != 1 or not lines[0].startswith("hybridpar: error:") or "Traceback" in err:
        return Outcome(name, False, f"{len(lines)} lines: {err.strip()[:200]}")
    if new_files:
        return Outcome(name, False, f"left {sorted(map(str, new_files))[:3]}")
    return Outcome(name, True, f"{wall:.1f}s: {lines[0][:150]}")


def other_inputs(d: Path) -> list[tuple[str, list[str]]]:
    """Bad inputs for plan/place/project, each run as a subprocess."""
    import yaml

    preset = Path(__file__).resolve().parents[1] / "src/hybridpar/cluster/presets/localhost.yaml"
    c = yaml.safe_load(preset.read_text())
    c["device"]["peak_flops"] = {"fp32": {"value": 1e-300, "source": "red team"}}
    (d / "tiny_flops.yaml").write_text(yaml.safe_dump(c))
    exit_model = _model_file(d, "plan_exit0", "def net():\n    sys.exit(0)\n")
    return [
        ("plan --gpus 1000000 --batch 1000000", ["plan", "--model", "small_cnn", "--cluster", "dgx1-v100",
                                                 "--gpus", "1000000", "--batch", "1000000"]),
        ("plan --time-share nan", ["plan", "--model", "small_cnn", "--cluster", "localhost", "--gpus", "2",
                                   "--batch", "8", "--time-share", "nan"]),
        ("plan cluster with peak_flops 1e-300", ["plan", "--model", "small_cnn", "--cluster",
                                                 str(d / "tiny_flops.yaml"), "--gpus", "2", "--batch", "8"]),
        ("plan factory sys.exit(0)", ["plan", "--model", exit_model, "--input-shape", "1,2,2", "--cluster",
                                      "localhost", "--gpus", "2", "--batch", "8"]),
    ]


def _limit_memory(limit: int) -> Callable[[], None]:
    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        os.setsid()
    return apply


def run_subprocess_input(name: str, argv: list[str], d: Path, timeout: float, mem: int) -> Outcome:
    before = set(d.rglob("*"))
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(BIN), *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=d, preexec_fn=_limit_memory(mem))
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return Outcome(name, False, f"still running after {timeout:.0f} s (killed)")
    return _judge(name, proc.returncode, err, time.perf_counter() - t0, set(d.rglob("*")) - before)


# -- faults --------------------------------------------------------------------------------------------

STEPS, EVERY = 12, 2


def _train(args: list[str], **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN), *T, "--steps", str(STEPS), *args], env={**ENV, **env}, capture_output=True,
                          text=True, timeout=600, check=False)


def _weights(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _complete(ck: Path) -> bool:
    from hybridpar.train import checkpoint as ckpt

    info = ckpt.latest_checkpoint(ck)
    return info is not None and all(bool(torch.isfinite(t).all()) for t in ckpt.full_model_state(info).values())


def _finish(name: str, ck: Path, out: Path, ref: dict, how: str) -> Outcome:
    """After a fault: the newest checkpoint is complete (or, for a fault before the first one, there is
    none at all) and --resume reaches the reference weights."""
    if not _complete(ck) and ck.is_dir() and any(p.name.startswith("step-") for p in ck.iterdir()):
        return Outcome(name, False, f"{how}; checkpoints left, none of them complete")
    run = _train(["--checkpoint-dir", str(ck), "--checkpoint-every", str(EVERY), "--resume", "--save", str(out)])
    if run.returncode != 0:
        return Outcome(name, False, f"{how}; resume exit {run.returncode}: {run.stderr.strip()[-200:]}")
    if not _same(_weights(out), ref):
        return Outcome(name, False, f"{how}; resumed weights differ from the uninterrupted run")
    start = next((ln for ln in run.stderr.splitlines() if "resuming from" in ln or "starting at" in ln), "?")
    return Outcome(name, True, f"{how}; {start.removeprefix('hybridpar: ')}; final weights bitwise equal")


def _signal_launcher(ck: Path, sig: int, after_ckpt: int) -> str:
    from hybridpar.train import checkpoint as ckpt

    proc = subprocess.Popen([str(BIN), *T, "--steps", str(STEPS), "--checkpoint-dir", str(ck), "--checkpoint-every",
                             str(EVERY)], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        info = ckpt.latest_checkpoint(ck, verify_hashes=False)
        if info is not None and info.step >= after_ckpt:
            break
        time.sleep(0.05)
    ranks = descendants(proc.pid)
    if proc.poll() is not None:
        return f"run ended before the signal (exit {proc.returncode})"
    proc.send_signal(sig)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "launcher did not stop within 60 s"
    t0 = time.monotonic()
    while any(alive(p) for p in ranks) and time.monotonic() - t0 < 30:
        time.sleep(0.1)
    left = [p for p in ranks if alive(p)]
    for p in left:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    return (f"{signal.Signals(sig).name} to the launcher after step {after_ckpt}: exit {proc.returncode}, "
            f"{len(ranks)} rank processes, {len(left)} left running")


def _corrupt(ck: Path, how: str) -> str:
    from hybridpar.train import checkpoint as ckpt

    newest = ckpt.latest_checkpoint(ck).path
    shard = newest / "rank-00001.pt"
    if how == "bit flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif how == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:1000])
    elif how == "deleted manifest":
        (newest / "manifest.json").unlink()
    elif how == "garbage manifest":
        (newest / "manifest.json").write_text("{not json")
    elif how == "deleted shard":
        shard.unlink()
    return f"{how} in {newest.name}"


def faults(work: Path, quick: bool, seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    ref_path = work / "ref.pt"
    run = _train(["--save", str(ref_path)])
    if run.returncode != 0:
        return [Outcome("reference run", False, run.stderr.strip()[-300:])]
    ref = _weights(ref_path)
    outcomes = []

    def fresh(name: str) -> tuple[Path, Path]:
        d = work / name.replace(" ", "_")
        d.mkdir()
        return d / "ck", d / "out.pt"

    # A rank dies (abrupt exit, as a kill) at a step: one line, exit 1, then --resume.
    for step in ([5] if quick else [1, 5, 8]):
        name = f"rank 1 dies before step {step}"
        ck, out = fresh(name)
        r = _train(["--checkpoint-dir", str(ck), "--checkpoint-every", str(EVERY)],
                   HYBRIDPAR_TEST_FAIL_RANK="1", HYBRIDPAR_TEST_FAIL_STEP=str(step))
        lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("hybridpar: test fault:")]
        if r.returncode != 1 or len(lines) != 1 or not lines[0].startswith("hybridpar: error: training failed"):
            outcomes.append(Outcome(name, False, f"exit {r.returncode}, {len(lines)} lines"))
            continue
        outcomes.append(_finish(name, ck, out, ref, "exit 1 with one line"))
    # Signals to the launcher alone: every rank stops, the newest checkpoint survives.
    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
    for sig in sigs if quick else sigs * 2:
        after = rng.choice([2, 4, 6, 8])
        name = f"{signal.Signals(sig).name} to the launcher after checkpoint {after}"
        ck, out = fresh(f"{name} {rng.random():.6f}")
        how = _signal_launcher(ck, sig, after)
        if "0 left running" not in how:
            outcomes.append(Outcome(name, False, how))
            continue
        outcomes.append(_finish(name, ck, out, ref, how))
    # Damaged checkpoints: --resume names and skips them and still reaches the same weights.
    base_ck, _ = fresh("base")
    r = _train(["--checkpoint-dir", str(base_ck), "--checkpoint-every", str(EVERY)],
               HYBRIDPAR_TEST_FAIL_RANK="0", HYBRIDPAR_TEST_FAIL_STEP="9")
    for how in ["bit flip", "truncated shard", "deleted manifest", "garbage manifest", "deleted shard"]:
        name = f"damaged newest checkpoint: {how}"
        ck, out = fresh(name)
        shutil.copytree(base_ck, ck)
        what = _corrupt(ck, how)
        outcomes.append(_finish(name, ck, out, ref, what))
    # Non-finite training: exit 3, nothing saved, every kept checkpoint finite; resume stops the same way.
    name = "loss goes NaN (--lr 1e6)"
    ck, out = fresh(name)
    r = _train(["--lr", "1e6", "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--save", str(out)])
    r2 = _train(["--lr", "1e6", "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--resume"])
    ok = r.returncode == 3 and r2.returncode == 3 and not out.exists() and _complete(ck)
    outcomes.append(Outcome(name, ok, f"exit {r.returncode} then {r2.returncode}: {r.stderr.strip()[:160]}"))
    # Another run into the same directory, during and after: refused, the first run unharmed.
    name = "second run into a directory in use"
    ck, out = fresh(name)
    first = subprocess.Popen([str(BIN), *T, "--steps", str(STEPS), "--checkpoint-dir", str(ck), "--checkpoint-every",
                              str(EVERY), "--save", str(out)], env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    while not (ck / ".hybridpar.lock").exists() and first.poll() is None:
        time.sleep(0.05)
    time.sleep(1.0)
    second = _train(["--checkpoint-dir", str(ck), "--checkpoint-every", str(EVERY), "--resume"])
    first.wait(timeout=600)
    ok = second.returncode == 2 and first.returncode == 0 and _same(_weights(out), ref)
    outcomes.append(Outcome(name, ok, f"second: exit {second.returncode} {second.stderr.strip()[:120]}; "
                                      f"first: exit {first.returncode}, weights equal the reference: "
                                      f"{out.exists() and _same(_weights(out), ref)}"))
    outcomes[-1].ok = outcomes[-1].ok and "in use by another run" in second.stderr
    name = "another run's checkpoints in the directory"
    r = _train(["--checkpoint-dir", str(ck), "--lr", "0.05", "--checkpoint-every", str(EVERY)])
    kept = sorted(p.name for p in ck.iterdir() if p.name.startswith("step-"))
    outcomes.append(Outcome(name, r.returncode == 2 and kept == ["step-00000010", "step-00000012"],
                            f"exit {r.returncode}; kept {kept}"))
    return outcomes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer fault repetitions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--inputs-only", action="store_true", help="bad inputs only, no fault runs")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per subprocess bad input")
    ap.add_argument("--memory", type=float, default=6.0, help="GiB of address space per subprocess bad input")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="hybridpar-redteam-") as tmp:
        d = Path(tmp)
        (d / "inputs").mkdir()
        bad = [run_train_input(n, a, d / "inputs") for n, a in train_inputs(d / "inputs")]
        bad += [run_subprocess_input(n, a, d / "inputs", args.timeout, int(args.memory * 2**30))
                for n, a in other_inputs(d / "inputs")]
        (d / "faults").mkdir()
        injected = [] if args.inputs_only else faults(d / "faults", args.quick, args.seed)
    for title, rows in (("bad inputs", bad), ("faults", injected)):
        good = sum(o.ok for o in rows)
        print(f"\n{title}: {good}/{len(rows)} handled")
        for o in rows:
            print(f"  {'ok  ' if o.ok else 'FAIL'} {o.name}: {o.detail}")
    summary = {"bad_inputs_tried": len(bad), "bad_inputs_handled": sum(o.ok for o in bad),
               "faults_injected": len(injected), "faults_survived": sum(o.ok for o in injected),
               "failures": [f"{o.name}: {o.detail}" for o in bad + injected if not o.ok]}
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}))
    out = os.environ.get("HYBRIDPAR_BENCH_OUT")
    if out:  # benchmarks/run_all.py collects this summary
        Path(out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
