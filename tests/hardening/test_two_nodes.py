"""Two nodes acted out on one machine (issue 33): two `torchrun --nnodes 2 --nproc-per-node 2`
agents meeting at a c10d rendezvous on 127.0.0.1 run `hybridpar train --plan` of a sample=2,channel=2
plan equal to one process; then a rank of one node dies mid-run and `--max-restarts 1` restarts
both nodes' ranks from the last checkpoint, reaching the uninterrupted two-node run bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridpar.cli.main import main
from hybridpar.train.launch import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

BIN = Path(sys.executable).parent
RUN = ["--batch", "8", "--steps", "4", "--json"]


def _env(**extra) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDPAR_COLLECTIVE_TIMEOUT_S": "60", **extra}


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _two_nodes(plan: Path, args: list[str], env: dict[str, str], restarts: int = 0) -> list:
    """Both nodes' torchrun agents, started together, waited for; their completed processes."""
    port = free_port()
    nodes = [subprocess.Popen([str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(i),
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hh2",
                               "--max-restarts", str(restarts), "-m", "hybridpar.cli.main", "train", "--plan",
                               str(plan), *RUN, *args],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    done = []
    for p in nodes:
        out, err = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def test_two_nodes_equal_one_process_and_resume_after_a_lost_rank(tmp_path, capsys):
    plan, one, two, resumed, ck = (tmp_path / n for n in ("plan.json", "one.pt", "two.pt", "resumed.pt", "ck"))
    assert main(["plan", "--model", "small_cnn", "--strategy", "sample=2,channel=2", "--gpus", "4", "--batch", "8",
                 "--out", str(plan)]) == 0
    assert main(["train", "--model", "small_cnn", "--strategy", "sample=1", *RUN, "--save", str(one)]) == 0
    capsys.readouterr()
    nodes = _two_nodes(plan, ["--save", str(two)], _env())
    assert all(n.returncode == 0 for n in nodes), [n.stderr[-2000:] for n in nodes]
    want, got = _weights(one), _weights(two)
    assert want.keys() == got.keys()
    for k in want:  # four ranks over two nodes train the one-process model
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=k)
    # Rank 3 exits abruptly before step 3 on the first attempt; checkpoints every 2 steps.
    nodes = _two_nodes(plan, ["--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--resume", "--save",
                              str(resumed)], _env(HYBRIDPAR_TEST_FAIL_RANK="3", HYBRIDPAR_TEST_FAIL_STEP="3"),
                       restarts=1)
    assert all(n.returncode == 0 for n in nodes), [n.stderr[-2000:] for n in nodes]
    assert any("test fault: rank 3 exits at step 3" in n.stderr for n in nodes)
    done = [s["step"] for n in nodes if n.stdout.strip() for s in json.loads(n.stdout)["steps"]]
    assert done == [2, 3]  # rank 0's node reports: the restarted ranks resumed from the step-2 checkpoint
    base, back = _weights(two), _weights(resumed)
    for k in base:
        assert torch.equal(base[k], back[k]), k
