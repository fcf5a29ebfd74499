"""examples/train_own_loop_1f1b.py under real torchrun (1F1B through torch.distributed.pipelining, AdamW, its
own loss, mp=2 and mp=2 x sample=2): the weights equal one process's."""

from __future__ import annotations

import pytest

from .test_example_torchrun import _check_example


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc,strategy", [(2, "mp=2"), (4, "mp=2,sample=2")])
def test_own_loop_1f1b_under_torchrun_equals_one_process(nproc, strategy):
    _check_example("train_own_loop_1f1b.py", nproc, ["--strategy", strategy])
