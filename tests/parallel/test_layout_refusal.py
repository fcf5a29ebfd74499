"""An op a channel/filter layout cannot serve is refused before any rank starts: exit 2, one line
naming the op and the module, no partial files (the dry run on meta tensors, hybridpar.parallel.check)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridpar.cli.main import main

MODEL = Path(__file__).parent / "refusal_models.py"


@pytest.mark.parametrize("strategy", ["channel=2", "filter=2"])
def test_unsupported_op_is_refused_before_start(tmp_path, capsys, strategy):
    save, metrics = tmp_path / "final.pt", tmp_path / "m.jsonl"
    code = main(["train", "--model", f"{MODEL}:net", "--input-shape", "3,8,8", "--strategy", strategy,
                 "--nproc", "2", "--batch", "4", "--steps", "1", "--save", str(save), "--metrics", str(metrics)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert "aten._unique2" in err and "'<model>'" in err and strategy in err
    assert not save.exists() and not metrics.exists()
