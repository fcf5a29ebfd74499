import json

import pytest

from hybridpar.cli.main import main
from hybridpar.convergence.builtin import load_curve


def test_measure_convergence_reduced_digits_run(tmp_path, capsys):
    out = tmp_path / "curve.json"
    rc = main(["measure-convergence", "--model", "small_cnn", "--data", "digits", "--target", "0.9",
               "--batches", "32,128,512", "--seeds", "1", "--out", str(out), "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    per = {r["batch"]: r["epochs_mean"] for r in res["per_batch"]}
    assert all(v is not None for v in per.values())
    # statistical efficiency falls with batch: more epochs at the large batch than at the small one
    assert per[512] > per[32]
    curve = load_curve(out)
    assert curve.curve.epochs(512) > curve.curve.epochs(32)
    assert res["curve"]["kind"] == "mccandlish"


@pytest.mark.parametrize("args", [["--batches", "16,x"], ["--target", "1.5"], ["--data", "mnist"],
                                  ["--model", "nope"], ["--seeds", "0"], ["--batches", "99999"]])
def test_measure_convergence_bad_input_exits_2(args, capsys):
    assert main(["measure-convergence", "--batches", "64", "--seeds", "1", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridpar: error:") and "Traceback" not in err
