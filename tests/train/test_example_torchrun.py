"""The own-loop examples under real torchrun: examples/train_own_loop.py (4 ranks, AdamW, a
non-cross-entropy loss; sample, channel/filter and spatial layouts) and examples/train_own_loop_mp.py
(model parallelism: two inputs, a dict output, AdamW, its own loss); the weights equal one process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _check_example(script: str, nproc: int, args: list[str], runs: int = 1) -> list[dict]:
    """Run `script --check` under torchrun: 5 steps per layout trained, and each one's largest weight
    difference from one process."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", str(nproc),
                           str(ROOT / "examples" / script), *args, "--check"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    check = [r for r in lines if "max_weight_diff" in r]
    assert len(check) == runs, proc.stdout
    for r in check:
        assert r["max_weight_diff"] <= 1e-4, r
    assert len([r for r in lines if "step" in r]) == 5 * runs
    return check


@pytest.mark.slow
def test_own_loop_under_torchrun_equals_one_process():
    # the layouts one after another in one launch (a torchrun start of 4 ranks is most of each run);
    # sample=2,height=2: the squeeze-excitation's mean over the split rows feeds a Linear whose gradient
    # is Partial(avg) over the spatial ranks (summed before: 2.4e-3 off after 5 steps)
    strategies = ["sample=4", "sample=2,channel=2", "channel=2,filter=2", "sample=2,height=2"]
    check = _check_example("train_own_loop.py", 4, ["--strategy", *strategies], runs=len(strategies))
    assert [r["strategy"] for r in check] == strategies


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc,args", [
    (2, ["--strategy", "mp=2"]),  # rank 0 runs the placer on the example batch
    (4, ["--strategy", "mp=2,sample=2", "--placement", '{"mlp": 1, "head": 1}']),
])
def test_own_loop_mp_under_torchrun_equals_one_process(nproc, args):
    _check_example("train_own_loop_mp.py", nproc, args)
