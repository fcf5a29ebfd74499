"""One vocabulary across commands: device count, cluster and batch have the same flag names, types and
defaults in every command that takes them; the old spellings still run but are not advertised."""

from __future__ import annotations

import json

import click
import pytest

from hybridpar.cli.main import build_app, main


def _params(command: str) -> dict[str, click.Parameter]:
    cmd = build_app().commands[command]
    return {p.name: p for p in cmd.params}


def _help(command: str) -> str:
    cmd = build_app().commands[command]
    with click.Context(cmd, info_name=command) as ctx:
        return cmd.get_help(ctx)


@pytest.mark.parametrize("command", ["plan", "place", "project"])
def test_same_names_types_and_defaults(command):
    p = _params(command)
    assert p["cluster"].opts == ["--cluster"] or p["cluster"].opts[0] == "--cluster"
    assert p["cluster"].default == "localhost"
    assert p["gpus"].opts[0] == "--gpus"
    if command == "project":  # a sweep: comma-separated device counts
        assert p["gpus"].default.startswith("1,2,4") and "batch" not in p
        assert p["batch_per_gpu"].opts == ["--batch-per-gpu"]
    else:
        assert p["gpus"].type is click.INT and p["gpus"].default == 2
        assert p["batch"].opts[0] == "--batch" and p["batch"].type is click.INT and p["batch"].default == 32


def test_old_spellings_are_hidden_aliases():
    place = _params("place")
    assert "--devices" in place["gpus"].opts
    text = _help("place")
    assert "--gpus" in text and "--devices" not in text
    for command in ("plan", "place", "project"):
        assert "--devices" not in _help(command) and "--nproc" not in _help(command)


def test_alias_and_new_name_give_the_same_placement(capsys):
    runs = []
    for flag in ("--devices", "--gpus"):
        assert main(["place", "--model", "small_cnn", flag, "2", "--solver", "greedy", "--json"]) == 0
        runs.append({k: v for k, v in json.loads(capsys.readouterr().out).items() if k != "solve_time_s"})
    assert runs[0] == runs[1] and runs[0]["devices"] == 2 and runs[0]["cluster"] == "localhost"
    assert runs[0]["batch"] == 32
    # A bad value given under the old name is still one line, naming the flag by its new name.
    assert main(["place", "--model", "small_cnn", "--devices", "0"]) == 2
    assert capsys.readouterr().err == "hybridpar: error: --gpus must be >= 1, got 0\n"


def test_plan_defaults_are_the_vocabulary_defaults(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "small_cnn", "--out", str(out), "--json"]) == 0
    plan = json.loads(out.read_text())
    assert (plan["world_size"], plan["batch"], plan["cluster"]) == (2, 32, "localhost")
    capsys.readouterr()


def test_bad_counts_are_one_line():
    import subprocess
    import sys

    for argv in (["plan", "--model", "small_cnn", "--gpus", "two"], ["project", "--model", "gnmt", "--gpus", "8,x"]):
        r = subprocess.run([sys.executable, "-m", "hybridpar.cli.main", *argv], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--gpus" in r.stderr, r.stderr
