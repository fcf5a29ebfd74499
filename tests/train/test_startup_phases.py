"""`hybridpar train` reports each start-up phase with its time as it ends (stderr), and in --json as
a `startup` object (issue 33, newcomer item 4: it printed nothing for 5-40 s while starting)."""

from __future__ import annotations

import json

import pytest

from hybridpar.cli.main import main

PHASES = ("loading and tracing the model", "dry run of the layout", "spawning ranks, building and the first step")


@pytest.mark.slow  # spawns two ranks
def test_train_reports_startup_phases(capsys):
    rc = main(["train", "--model", "small_cnn", "--strategy", "channel=2", "--batch", "4", "--steps", "1",
               "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = [line for line in err.splitlines() if line.startswith("hybridpar: start-up: ")]
    for name in PHASES:  # printed in order, each with its time
        assert sum(line.startswith(f"hybridpar: start-up: {name} ") and line.endswith(" s") for line in lines) == 1, err
    assert [next(i for i, line in enumerate(lines) if name in line) for name in PHASES] == sorted(
        next(i for i, line in enumerate(lines) if name in line) for name in PHASES)
    startup = json.loads(out)["startup"]
    assert set(PHASES) <= set(startup) and all(v > 0 for v in startup.values())
