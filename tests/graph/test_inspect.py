"""`hybridpar inspect` through the CLI entry point."""

import json
from pathlib import Path

import pytest

from hybridpar.cli.main import main

USER = Path(__file__).parent / "data" / "user_models.py"


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_zoo_model_json(capsys):
    out = _json(capsys, ["inspect", "--model", "small_cnn", "--batch", "4", "--json"])
    layers = out["layers"]
    assert out["batch"] == 4 and out["tracer"] == "torch.fx" and len(layers) == out["nodes"] == 18
    assert out["totals"]["params"] == sum(r["params"] for r in layers) == 17_082
    assert out["totals"]["fwd_flops"] == sum(r["fwd_flops"] for r in layers)
    conv = next(r for r in layers if r["op"] == "conv2d")
    assert conv["out_shape"] == [4, 16, 32, 32] and conv["activation_bytes"] == 4 * 16 * 32 * 32 * 4
    assert conv["param_bytes"] == conv["params"] * 4


def test_inspect_table_has_totals(capsys):
    assert main(["inspect", "--model", "small_resnet", "--dtype", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "TOTAL" in text and "78,042" in text and "small_resnet" in text


def test_inspect_user_file_with_input_shape(capsys):
    out = _json(capsys, ["inspect", "--model", f"{USER}:factory", "--input-shape", "3,32,32", "--json"])
    ops = [r["op"] for r in out["layers"]]
    assert ops == ["input", "conv2d", "batchnorm", "relu", "maxpool", "flatten", "linear"]
    assert out["layers"][-1]["module"] == "head" and out["layers"][1]["module"] == "features.0"
    assert out["totals"]["params"] == 3 * 8 * 9 + 8 + 16 + 8 * 16 * 16 * 10 + 10


def test_inspect_user_factory_returning_inputs(capsys):
    out = _json(capsys, ["inspect", "--model", f"{USER}:with_inputs", "--json"])
    assert out["batch"] == 4 and out["layers"][1]["out_shape"] == [4, 8, 32, 32]


def test_inspect_coarsened(capsys):
    out = _json(capsys, ["inspect", "--model", "small_resnet", "--coarsen", "6", "--json"])
    full = _json(capsys, ["inspect", "--model", "small_resnet", "--json"])
    assert out["nodes"] <= 6
    members = [m for r in out["layers"] for m in r["members"]]
    assert sorted(members) == sorted(r["name"] for r in full["layers"])
    assert out["totals"]["fwd_flops"] == full["totals"]["fwd_flops"]


@pytest.mark.parametrize("argv,needle", [
    (["--model", "no_such_model"], "unknown model"),
    (["--model", "missing/file.py:factory", "--input-shape", "3,32,32"], "not found"),
    (["--model", f"{USER}:broken", "--input-shape", "3,32,32"], "out of coffee"),
    (["--model", f"{USER}:not_a_module"], "not an nn.Module"),
    (["--model", f"{USER}:factory"], "--input-shape"),
    (["--model", f"{USER}:factory", "--input-shape", "3,8,8"], "cannot trace"),
    (["--model", "small_cnn", "--batch", "-3"], "batch"),
    (["--model", "small_cnn", "--input-shape", "3,x,32"], "--input-shape"),
    (["--model", "small_cnn", "--coarsen", "0"], "--coarsen"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    assert main(["inspect", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hybridpar: error:") and needle in err


def test_unreadable_factory_file(capsys, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def factory(:\n")
    assert main(["inspect", "--model", f"{bad}:factory", "--input-shape", "3,32,32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot import" in err
    unreadable = tmp_path / "dir.py"
    unreadable.mkdir()
    assert main(["inspect", "--model", f"{unreadable}:factory"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
