import json
import os
import subprocess
from pathlib import Path

import pytest


def plan_dict(**over) -> dict:
    """A valid hand-made plan with a prediction (what `hybridpar plan --out` writes)."""
    d = {
        "schema_version": 1, "model": "small_resnet", "world_size": 4, "batch": 32, "dp": 4, "mp": 1,
        "default_layout": {"sample": 4},
        "layers": {"layers.0.conv1": {"sample": 2, "channel": 2}},
        "predicted": {
            "step_time_s": 0.012, "compute_s": 0.009, "comm_s": 0.004, "exposed_comm_s": 0.002,
            "idle_s": 0.001, "memory_bytes": [10**8, 10**8, 9 * 10**7, 9 * 10**7],
            "comm_bytes": {"allreduce": 1_200_000, "allgather": 300_000},
            "per_layer": {"layers.0.conv1": {"compute_s": 0.001, "comm_s": 0.0004}, "fc": {"compute_s": 2e-4}},
        },
    }
    d.update(over)
    return d


def run_dict() -> dict:
    """The shape of `hybridpar train --json` output the report reads."""
    return {"world_size": 4, "strategy": "sample=4",
            "steps": [{"step": i, "loss": 2.3 - 0.1 * i, "time_s": t} for i, t in enumerate([0.05, 0.02, 0.0201])],
            "comm_bytes_per_step": {"allreduce": 1_000_000}}


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(plan_dict()))
    return p


@pytest.fixture
def run_file(tmp_path: Path) -> Path:
    p = tmp_path / "run.json"
    p.write_text(json.dumps(run_dict()))
    return p


# Fuzz tallies, printed at the end of the run (the issue asks for the counts to be shown).
FUZZ_COUNTS: dict[str, int] = {}


def pytest_sessionfinish(session, exitstatus):
    """This process's tallies, for tests/conftest.py's summary of the whole run (xdist workers too)."""
    if FUZZ_COUNTS:
        shared = Path(os.environ["HYBRIDPAR_TEST_SHARED"])
        (shared / f"fuzz-{os.getpid()}.json").write_text(json.dumps(FUZZ_COUNTS))


class SpawnAttempt(AssertionError):
    pass


def _no_spawn(*_a, **_k):
    raise SpawnAttempt("a process was spawned for malformed input (validation must come first)")


@pytest.fixture
def no_spawn(monkeypatch):
    """Any fork/exec (subprocess, multiprocessing, torch spawn) fails the test."""
    import _posixsubprocess

    # user code runs first in a forked trial child (hybridpar.user_code): a check of its own, not a
    # rank starting; off here so that any fork still means validation came too late
    monkeypatch.setenv("HYBRIDPAR_USER_CODE_TIMEOUT_S", "0")
    for mod, name in [(os, "fork"), (os, "posix_spawn"), (os, "posix_spawnp"), (_posixsubprocess, "fork_exec"),
                      (subprocess.Popen, "_execute_child")]:
        monkeypatch.setattr(mod, name, _no_spawn)
