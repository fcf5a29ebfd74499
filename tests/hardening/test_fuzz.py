"""Fuzz: malformed plans, strategy strings and cluster files thrown at the Python API and the CLI.

Every input either loads or is rejected with a UserError (CLI: exit 2 and one line on stderr); no
other exception, no hang (pytest-timeout), no output file left behind, and no process spawned.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridpar.cli.main import build_app, main
from hybridpar.errors import UserError
from hybridpar.plans import load_plan, parse_strategy, plan_from_dict

from .conftest import FUZZ_COUNTS, SpawnAttempt, plan_dict
from .fuzzgen import file_text, mutated, strategy_text

pytestmark = pytest.mark.timeout(240)

_SETTINGS = {"deadline": None, "database": None, "print_blob": True,
                 "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}

PLAN_BASES = [
    plan_dict(),
    {"schema_version": 1, "model": "small_cnn", "world_size": 2, "batch": 8, "default_layout": {"sample": 2},
     "dp": 2},
    {"schema_version": 1, "model": "small_cnn", "world_size": 4, "batch": 16, "dp": 2, "mp": 2,
     "default_layout": {"sample": 2}, "placement": {"0": 0, "3": 1, "8": 1}, "strategy": "mp=2,sample=2"},
]
CLUSTER_DIR = Path(__file__).resolve().parents[2] / "src/hybridpar/cluster/presets"


def _commands() -> set[str]:
    return set(build_app().commands)


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _assert_clean_rejection(rc: int, err: str, argv: list[str]) -> None:
    assert rc == 2, f"{argv}: exit {rc}, stderr {err!r}"
    assert err.startswith("hybridpar: error:") and err.count("\n") == 1, f"{argv}: {err!r}"


def _tally(name: str, counts: Counter) -> None:
    for k, v in counts.items():
        FUZZ_COUNTS[f"{name}: {k}"] = FUZZ_COUNTS.get(f"{name}: {k}", 0) + v


def test_spawn_guard_works(no_spawn):
    with pytest.raises(SpawnAttempt):
        subprocess.run(["true"], check=False)
    import torch.multiprocessing as tmp

    with pytest.raises(SpawnAttempt):
        tmp.spawn(print, nprocs=1)


def test_plan_dicts_api():
    seen: Counter = Counter()

    @settings(max_examples=400, **_SETTINGS)
    @given(mutated(PLAN_BASES))
    def check(doc):
        try:
            plan = plan_from_dict(doc)
        except UserError:
            seen["rejected"] += 1
            return
        seen["accepted"] += 1
        # A plan that validates must survive its own save/load unchanged.
        assert plan_from_dict(json.loads(plan.to_json())) == plan

    check()
    _tally("plan_from_dict", seen)
    assert seen["rejected"] >= 200


def test_plan_files_cli(no_spawn):
    seen: Counter = Counter()
    train = "train" in _commands()

    @settings(max_examples=250, **_SETTINGS)
    @given(file_text(PLAN_BASES))
    def check(data):
        with tempfile.TemporaryDirectory() as d:
            plan, out = Path(d) / "plan.json", Path(d) / "out" / "report.html"
            plan.write_bytes(data)
            try:
                load_plan(plan)
                valid = True
            except UserError:
                valid = False
            argv = ["report", "--plan", str(plan), "--out", str(out), "--json"]
            rc, _, err = _cli(argv)
            if valid:
                assert rc == 0 and out.is_file(), err
                seen["accepted"] += 1
                return
            _assert_clean_rejection(rc, err, argv)
            assert sorted(p.name for p in Path(d).rglob("*")) == ["plan.json"], "partial output left behind"
            seen["rejected"] += 1
            seen["report CLI exit 2"] += 1
            if train:
                argv = ["train", "--plan", str(plan), "--steps", "1", "--json"]
                _assert_clean_rejection(*_cli(argv)[::2], argv)
                seen["train CLI exit 2"] += 1

    check()
    _tally("plan files via CLI", seen)
    assert seen["rejected"] >= 150


def test_strategy_strings(no_spawn):
    seen: Counter = Counter()
    consumers = [c for c in ("train", "plan") if c in _commands()]

    @settings(max_examples=400, **_SETTINGS)
    @given(strategy_text(), st.one_of(st.none(), st.integers(1, 64)))
    def check(text, world):
        try:
            strat = parse_strategy(text, world)
        except UserError:
            seen["rejected"] += 1
        else:
            seen["accepted"] += 1
            assert world is None or strat.world_size == world
            return
        ranks = str(world or 4)
        for cmd in consumers:
            argv = {"train": ["train", "--model", "small_cnn", "--strategy", text, "--nproc", ranks,
                              "--steps", "1", "--data", "synthetic", "--json"],
                    "plan": ["plan", "--model", "small_cnn", "--cluster", "localhost", "--gpus", ranks,
                             "--batch", "32", "--strategy", text, "--json"]}[cmd]
            if world is None and cmd == "train":
                continue  # parse_strategy without a rank count accepts fewer strings than train sees
            _assert_clean_rejection(*_cli(argv)[::2], argv)
            seen[f"{cmd} CLI exit 2"] += 1

    check()
    _tally("strategy strings", seen)
    assert seen["rejected"] >= 200


def _cluster_bases() -> list:
    return [yaml.safe_load(p.read_text()) for p in sorted(CLUSTER_DIR.glob("*.yaml"))]


def test_cluster_files(no_spawn):
    from hybridpar import cluster

    if not hasattr(cluster, "load_cluster") or not _cluster_bases():
        pytest.skip("hybridpar.cluster.load_cluster / presets not in this build yet")
    seen: Counter = Counter()
    consumers = [c for c in ("plan", "place", "project") if c in _commands()]

    @settings(max_examples=300, **_SETTINGS)
    @given(file_text(_cluster_bases(), dump=lambda d: yaml.safe_dump(d, sort_keys=False)),
           st.sampled_from([None, 1, 2, 8, 0, -1]))
    def check(data, gpus):
        with tempfile.TemporaryDirectory() as d:
            path, out = Path(d) / "c.yaml", Path(d) / "plan.json"
            path.write_bytes(data)
            with contextlib.suppress(UserError):  # the gpus argument is validated too
                cluster.load_cluster(str(path), gpus=gpus)
            try:
                cluster.load_cluster(str(path))
            except UserError:
                seen["rejected"] += 1
            else:
                seen["accepted"] += 1
                return
            for cmd in consumers:
                argv = {"plan": ["plan", "--model", "small_cnn", "--cluster", str(path), "--gpus", "2",
                                 "--batch", "8", "--out", str(out)],
                        "place": ["place", "--model", "small_cnn", "--cluster", str(path), "--devices", "2"],
                        "project": ["project", "--model", "small_cnn", "--cluster", str(path), "--gpus", "2,4"]}[cmd]
                _assert_clean_rejection(*_cli(argv)[::2], argv)
                assert not out.exists(), "partial output left behind"
                seen[f"{cmd} CLI exit 2"] += 1

    check()
    _tally("cluster files", seen)
    assert seen["rejected"] >= 100
