"""Output for people: tables are not cut when piped, each time column has one unit, and what the plan
says about data parallelism is said once."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from hybridpar.cli.main import main
from hybridpar.cli.output import in_unit, time_columns, time_unit


def test_piped_inspect_shows_every_layer_name_and_shape_whole(capsys):
    assert main(["inspect", "--model", "resnet50", "--json"]) == 0
    layers = json.loads(capsys.readouterr().out)["layers"]
    # As a user runs `hybridpar inspect --model resnet50 | cat`: stdout is a pipe, stdin/stderr may be a tty.
    r = subprocess.run([sys.executable, "-m", "hybridpar.cli.main", "inspect", "--model", "resnet50"],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=300,
                       env={**__import__("os").environ, "COLUMNS": "80"})
    assert r.returncode == 0
    text = r.stdout
    assert "…" not in text and "\x1b[" not in text  # nothing elided, no colour codes in a pipe
    cells = {c.strip() for line in text.splitlines() for c in line.split("│")}
    names = {row["name"] for row in layers}
    assert len(names) > 170 and names <= cells
    assert "layer4.2.downsample" in text or "layer1.0.downsample.0" in text
    assert "1x2048x7x7" in text
    assert max(len(line) for line in text.splitlines()) > 120  # wider than any terminal default


def test_time_columns_use_one_unit_each():
    assert time_unit([0.004, 2.5e-5]) == ("ms", 1e-3)
    assert time_unit([7200.0, 30.0]) == ("h", 3600.0)
    assert time_unit([None, 0.0]) == ("s", 1.0)
    (h1, c1), (h2, c2) = time_columns(["compute", "comm"], [[0.25, 0.004], [9.2e-6, 0.0]], same_unit=True)
    assert (h1, h2) == ("compute (ms)", "comm (ms)") and c1 == ["250.0", "4.00"] and c2 == ["0.0092", "0"]
    (h, c), = time_columns(["time"], [[90000.0, 3600.0 * 5, None]])
    assert h == "time (d)" and c == ["1.04", "0.208", "-"]
    assert in_unit(float("nan"), 1.0) == "-"


def _column(text: str, header: str) -> list[str]:
    """The cells under `header` in a rich box table."""
    lines = text.splitlines()
    head = next(i for i, ln in enumerate(lines) if header in ln)
    idx = [c.strip() for c in lines[head].split("┃")].index(header)
    rows = [ln for ln in lines[head + 1:] if ln.startswith("│")]
    return [[c.strip() for c in ln.split("│")][idx] for ln in rows]


def test_project_time_column_has_one_unit(tmp_path, capsys):
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"curve": {"kind": "mccandlish", "e_min": 5.0, "b_noise": 256.0, "b_noise_sd": 30.0},
                                 "samples_per_epoch": 5_000_000}))
    assert main(["project", "--model", "small_cnn", "--cluster", "dgx1-v100", "--gpus", "1,8,512",
                 "--placer", "greedy", "--cf-max-gpus", "0", "--mp", "2", "--convergence", str(curve)]) == 0
    text = capsys.readouterr().out
    header = re.search(r"time \((d|h|s|ms|us)\)", text)
    assert header, text
    cells = _column(text, header.group(0))
    assert len(cells) == 3 and all(re.fullmatch(r"[0-9.,]+", c) for c in cells), cells


def test_plan_units_in_headers_and_the_dp_note_once(capsys):
    assert main(["plan", "--model", "small_resnet", "--gpus", "4", "--batch", "6"]) == 0
    text = capsys.readouterr().out
    for h in ("compute (", "comm (", "time (", "exposed ("):
        assert h in text
    # each baseline says once why it is out; the planner's note does not repeat data parallelism's
    assert text.count("data parallelism needs the batch (6) divisible by 4") == 1
    assert text.count("FSDP + full recomputation needs the batch (6) divisible by 4") == 1
    assert "data parallelism: data parallelism" not in text
    for line in text.splitlines():
        if line.startswith("│"):
            assert not re.search(r"\d (ms|us|s|h)\b", line), line  # units live in the headers


@pytest.mark.parametrize("argv", [["models"], ["clusters"]])
def test_other_tables_are_whole_when_captured(argv, capsys):
    assert main(argv) == 0
    assert "…" not in capsys.readouterr().out


def test_place_gives_every_step_duration_in_one_unit(capsys):
    assert main(["place", "--model", "small_cnn", "--solver", "greedy", "--cluster", "dgx1-v100"]) == 0
    text = capsys.readouterr().out
    units = set(re.findall(r"\((d|h|s|ms|us)\)", text))
    assert len(units) == 1, units  # the step rows and the baselines' column share it
    rows = [ln for ln in text.splitlines() if ln.startswith("│") and "solver" not in ln]
    assert rows and not any(re.search(r"\d (ms|us|s|h)\b", ln) for ln in rows)
    assert "baselines" in text and re.search(r"step \((ms|us|s)\)", text)
