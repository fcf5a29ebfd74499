"""An op a channel/filter layout cannot serve is refused before any rank starts: exit 2, one line
naming the op and the module, no partial files (the dry run on meta tensors, hybridpar.runtime.dry_run)."""

from __future__ import annotations

import pytest

from hybridpar.cli.main import main

NET = '''
import torch
from torch import nn


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        h = self.conv(x)
        distinct = torch.unique(h.argmax(1)).numel()  # a data-dependent shape: no DTensor rule
        return self.head(h.mean((2, 3))) * distinct


def net():
    return Counting()
'''


@pytest.mark.parametrize("strategy", ["channel=2", "filter=2"])
def test_unsupported_op_is_refused_before_start(tmp_path, capsys, strategy):
    (tmp_path / "net.py").write_text(NET)
    save, metrics = tmp_path / "final.pt", tmp_path / "m.jsonl"
    code = main(["train", "--model", f"{tmp_path / 'net.py'}:net", "--input-shape", "3,8,8", "--strategy", strategy,
                 "--nproc", "2", "--batch", "4", "--steps", "1", "--save", str(save), "--metrics", str(metrics)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert "aten._unique2" in err and "'<model>'" in err and strategy in err
    assert not save.exists() and not metrics.exists()
