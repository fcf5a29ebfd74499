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


# -- train options: non-finite numbers, huge shapes, raising forwards, foreign checkpoints ---------------

_BAD_OPTION = st.one_of(
    st.tuples(st.sampled_from(["--lr", "--momentum", "--weight-decay"]),
              st.sampled_from(["nan", "inf", "-inf", "1e309", "-1", "NaN", "-nan"])),
    st.tuples(st.just("--lr"), st.sampled_from(["0", "-0.0", "-1e-9"])),
    st.tuples(st.just("--seed"), st.one_of(st.integers(2**63, 2**80), st.integers(-(2**70), -1)).map(str)),
    st.tuples(st.just("--input-shape"), st.one_of(
        st.lists(st.integers(100_000, 10**12), min_size=2, max_size=3).map(lambda d: ",".join(map(str, [3, *d]))),
        st.sampled_from(["3,1,1", "3,2,2", "3,0,32", "3,-4,32", "1," + "9" * 25 + ",1"]))),
    st.tuples(st.sampled_from(["--batch", "--steps", "--synthetic-size", "--nproc"]),
              st.integers(-(2**40), 0).map(str)),
    st.tuples(st.just("--batch"), st.integers(10**7, 10**12).map(str)),
)


def test_train_bad_numbers_and_shapes(no_spawn):
    seen: Counter = Counter()

    @settings(max_examples=120, **_SETTINGS)
    @given(_BAD_OPTION)
    def check(opt):
        flag, value = opt
        argv = ["train", "--model", "small_cnn", "--strategy", "sample=2", "--batch", "8", "--steps", "1",
                "--json", f"{flag}={value}"]
        _assert_clean_rejection(*_cli(argv)[::2], argv)
        seen[f"{flag} rejected"] += 1
        seen["rejected"] += 1

    check()
    _tally("train numbers and shapes", seen)
    assert seen["rejected"] >= 100


_RAISES = ["ValueError('x')", "RuntimeError('shape mismatch')", "ZeroDivisionError()", "IndexError(3)",
           "KeyError('k')", "AssertionError()", "TypeError('t')", "SystemExit(0)", "SystemExit(3)",
           "NotImplementedError()", "MemoryError()", "OverflowError()"]
_RETURNS = ["x.sum()", "None", "(x, x)", "'text'", "x.flatten()", "[x]", "{'a': x}"]


def test_train_raising_or_odd_forwards(no_spawn):
    seen: Counter = Counter()

    @settings(max_examples=40, **_SETTINGS)
    @given(st.one_of(st.sampled_from(_RAISES).map(lambda e: f"raise {e}"),
                     st.sampled_from(_RETURNS).map(lambda r: f"return {r}")),
           st.sampled_from(["forward", "factory"]))
    def check(stmt, where):
        with tempfile.TemporaryDirectory() as d:
            f = Path(d) / "m.py"
            body = ("import sys\nimport torch\nfrom torch import nn\n"
                    "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                    "        self.l = nn.Linear(4, 2)\n    def forward(self, x):\n"
                    + (f"        {stmt}\n" if where == "forward" else "        return self.l(x.flatten(1))\n")
                    + "def net():\n" + (f"    {stmt}\n" if where == "factory" else "    return Net()\n"))
            f.write_text(body)
            argv = ["train", "--model", f"{f}:net", "--input-shape", "1,2,2", "--strategy", "sample=1",
                    "--nproc", "1", "--batch", "4", "--steps", "1"]
            _assert_clean_rejection(*_cli(argv)[::2], argv)
        seen[f"{where} rejected"] += 1
        seen["rejected"] += 1

    check()
    _tally("train model files", seen)
    assert seen["rejected"] >= 30


def test_train_foreign_checkpoints(no_spawn):
    """A checkpoint directory holding another run's checkpoint (any identity key changed): exit 2."""
    import hashlib

    from hybridpar.train.checkpoint import manifest_digest, run_id
    from hybridpar.train.config import run_config

    base = run_config(model="small_cnn", strategy="sample=2", batch=8, steps=1).config.identity
    seen: Counter = Counter()

    @settings(max_examples=60, **_SETTINGS)
    @given(st.sampled_from(sorted(base)), st.one_of(st.integers(-5, 5), st.floats(allow_nan=False),
                                                    st.text(max_size=5), st.none(), st.booleans()),
           st.sampled_from([[], ["--resume"], ["--resume=if-any"]]))
    def check(key, value, resume):
        if base[key] == value:
            return
        identity = {**base, key: value}
        with tempfile.TemporaryDirectory() as d:
            step = Path(d) / "ck" / "step-00000002"
            step.mkdir(parents=True)
            (step / "rank-00000.pt").write_bytes(b"x" * 10)
            files = [{"rank": 0, "file": "rank-00000.pt", "bytes": 10,
                      "sha256": hashlib.sha256(b"x" * 10).hexdigest()}]
            manifest = json.loads(json.dumps(  # as read back: JSON's values (str for what JSON lacks)
                {"format": "hybridpar-checkpoint", "version": 1, "step": 2, "world_size": 1, "files": files,
                 "identity": identity, "run_id": run_id(identity)}, default=str))
            manifest["manifest_sha256"] = manifest_digest(manifest)  # well formed: refused for its identity alone
            (step / "manifest.json").write_text(json.dumps(manifest))
            argv = ["train", "--model", "small_cnn", "--strategy", "sample=2", "--batch", "8", "--steps", "1",
                    "--checkpoint-dir", str(Path(d) / "ck"), *resume]
            rc, _, err = _cli(argv)
            _assert_clean_rejection(rc, err, argv)
            assert "another run's checkpoints" in err, err
            assert sorted(p.name for p in step.iterdir()) == ["manifest.json", "rank-00000.pt"]
        seen["rejected"] += 1

    check()
    _tally("train foreign checkpoints", seen)
    assert seen["rejected"] >= 40
