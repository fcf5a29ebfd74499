"""TrainConfig.callbacks ("module:function", run on rank 0 after each step): a callback is told of a step
only once that step's state is judged finite, and sees that step's state, not a later one's (under a
split layout the guard's verdict is agreed with the next step: hybridpar.train.guard.submit)."""

from __future__ import annotations

import pytest

SEEN: list[tuple[int, int]] = []


def record(info, engine, opt) -> None:
    """(the step told of, how many optimizer steps the state has taken)."""
    taken = {int(st["step"]) for st in opt.state.values() if "step" in st}
    SEEN.append((info.step, taken.pop() if len(taken) == 1 else -1))


def _run(strategy: str) -> list[tuple[int, int]]:
    from hybridpar.train.config import run_config
    from hybridpar.train.trainer import run_rank

    setup = run_config(model="small_cnn", strategy=strategy, batch=8, steps=4, optimizer="adamw", lr=1e-3,
                       callbacks=(f"{__name__}:record",))
    SEEN.clear()
    run_rank(setup.config)
    return list(SEEN)


@pytest.mark.slow
def test_a_callback_sees_the_state_of_the_step_it_is_told_of():
    from hybridpar.train.launch import spawn

    assert spawn(_run, 2, "channel=2") == [(0, 1), (1, 2), (2, 3), (3, 4)]
