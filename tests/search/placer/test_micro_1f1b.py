"""1F1B priced as torch's Schedule1F1B runs it (placer.micro): GPipe's bubble in time, at most S - s
micro-batches' activations on stage s in memory, the count and schedule chosen together under the memory
limit, chain placements only (and a chain split found when 1f1b is asked), `place --schedule`."""

from __future__ import annotations

import json

import pytest

from hybridpar.search.placer import PlacementProblem, Task, uniform_links
from hybridpar.search.placer.micro import (
    chain_devices,
    chain_split,
    choose_pipeline,
    micro_batch_step_s,
    pipeline_memory,
)

US = 1e-6
ACT = 1000  # each compute task's kept activations (bytes, whole batch)


def _chain(stages: int, per: int = 2, cap: int = 10**9) -> tuple[PlacementProblem, list[int], list[int]]:
    """An input, then `stages * per` tasks in a line (forward 10 us, backward 20 us, 2000 B resident of
    which ACT are activations), free (empty) transfers; the placement puts `per` consecutive tasks on each
    device."""
    bws, lat, links = uniform_links(stages, 1e18)
    tasks = [Task("in", (), (0.0,) * stages, (0.0,) * stages)]
    for i in range(stages * per):
        tasks.append(Task(f"t{i}", (tasks[-1].name,), (10 * US,) * stages, (20 * US,) * stages, mem_bytes=2000))
    prob = PlacementProblem("chain", tuple(tasks), stages, (cap,) * stages, bws, lat, links, program_order=True)
    return prob, [0] + [i // per for i in range(stages * per)], [0] + [ACT] * (stages * per)


@pytest.mark.parametrize("stages,k", [(2, 2), (2, 4), (3, 3), (3, 8)])
def test_1f1b_has_the_gpipe_bubble(stages, k):
    """(K + S - 1) slots of one micro-batch's stage time (2 tasks x 30 us / K), like GPipe."""
    prob, assign, _ = _chain(stages)
    want = (k + stages - 1) * 60 * US / k
    assert micro_batch_step_s(prob, assign, k, "1f1b") == pytest.approx(want, rel=1e-9)
    assert micro_batch_step_s(prob, assign, k, "gpipe") == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("stages,k", [(2, 4), (2, 8), (3, 4), (3, 16)])
def test_1f1b_holds_fewer_activations_than_gpipe_for_more_micro_batches_than_stages(stages, k):
    prob, assign, act = _chain(stages)
    gpipe = pipeline_memory(prob, assign, k, "gpipe", act)
    one = pipeline_memory(prob, assign, k, "1f1b", act)
    assert gpipe == [4000] * stages  # every micro-batch's activations held: the whole batch's
    for s in range(stages):  # stage s holds S - s micro-batches' activations of its 2 tasks
        assert one[s] == 4000 - 2 * ACT + -(-2 * ACT * (stages - s) // k)
    assert max(one) < max(gpipe)


def test_choice_is_joint_and_under_the_memory_limit():
    prob, assign, act = _chain(2)
    k, sched, steps, fits = choose_pipeline(prob, assign, 8, act)
    assert (k, sched, fits) == (8, "1f1b", True)  # the fastest count; equal steps: the smaller memory
    assert steps[(8, "1f1b")] == pytest.approx(steps[(8, "gpipe")])
    # a device of 3700 B: GPipe (4000 B) never fits; 1F1B fits from K = 4 (stage 0: 2000 + 2 x 1000 x 2/K)
    tight, _, _ = _chain(2, cap=3700)
    k, sched, steps, fits = choose_pipeline(tight, assign, 8, act, counts=[1, 2, 4], schedules=("gpipe", "1f1b"))
    assert (k, sched, fits) == (4, "1f1b", True)
    # nothing fits 2500 B: the smallest peak (1F1B at the most micro-batches), and it says so (the plan's note:
    # tests/search/placer/test_place_notes.py)
    none, _, _ = _chain(2, cap=2500)
    assert choose_pipeline(none, assign, 8, act, counts=[1, 2, 4])[::3] == (4, False)
    assert choose_pipeline(none, assign, 8, act, counts=[1, 2, 4])[1] == "1f1b"


def test_only_chains_price_1f1b():
    prob, assign, act = _chain(2)
    back = [0, 0, 1, 0, 0]  # device 0 -> 1 -> 0
    assert chain_devices(prob, back) is None and chain_devices(prob, assign) == (0, 1)
    assert chain_devices(prob, [0, 0, 0, 0, 0]) is None  # one device: no stages
    _, sched, steps, _ = choose_pipeline(prob, back, 8, act)
    assert sched == "gpipe" and all(s == "gpipe" for _, s in steps)
    with pytest.raises(ValueError, match="chain"):
        micro_batch_step_s(prob, back, 4, "1f1b")
    flipped = [1, 1, 1, 0, 0]  # the input read on device 1: stages 1 -> 0
    assert chain_devices(prob, flipped) == (1, 0)
    assert chain_split(prob) == (0, 0, 0, 1, 1)


def test_an_input_placed_on_the_last_stage_is_fed_to_the_first():
    """The placer may put the (free) input task on any device; the data loader feeds the first stage,
    so 1F1B is priced as if it sat there (it was a ValueError: the replay found the last stage waiting
    on its own backward before sending the next micro-batch's input)."""
    prob, assign, act = _chain(2)
    elsewhere = [1, *assign[1:]]  # the input on device 1, its consumer on device 0
    assert chain_devices(prob, elsewhere) == (0, 1)
    for k in (2, 4):
        assert micro_batch_step_s(prob, elsewhere, k, "1f1b") == micro_batch_step_s(prob, assign, k, "1f1b")
    assert choose_pipeline(prob, elsewhere, 8, act)[1] == "1f1b"


def test_place_schedule_1f1b(tmp_path, capsys):
    from hybridpar.cli.main import main

    out = tmp_path / "plan.json"
    assert main(["place", "--model", "lstm2", "--gpus", "2", "--solver", "greedy", "--batch", "8",
                 "--schedule", "1f1b", "--out", str(out), "--json"]) == 0
    summary, plan = json.loads(capsys.readouterr().out), json.loads(out.read_text())
    assert plan["schedule"] == "1f1b" == summary["schedule"] and plan["micro_batches"] >= 2
    assert sorted(set(plan["placement"].values())) == [0, 1]  # a chain over both devices
    assert "schedule: 1f1b (as asked)" in plan["notes"]
    assert main(["place", "--model", "lstm2", "--gpus", "2", "--solver", "greedy", "--batch", "8",
                 "--schedule", "1f1b", "--micro-batches", "1"]) == 2
    assert "at least as many micro-batches" in capsys.readouterr().err


def test_received_activations_are_held_per_micro_batch_in_flight_too():
    import dataclasses

    prob, assign, act = _chain(2)
    tasks = list(prob.tasks)
    tasks[2] = dataclasses.replace(tasks[2], out_bytes=400)  # t1 (device 0) -> t2 (device 1)
    prob = dataclasses.replace(prob, tasks=tuple(tasks))
    assert pipeline_memory(prob, assign, 4, "gpipe", act) == [4000, 4400]  # the receive buffer, whole batch
    # device 1 (stage 1 of 2) holds one micro-batch in flight of 4: its 2000 B of activations and 400 B received
    assert pipeline_memory(prob, assign, 4, "1f1b", act) == [4000 - 2000 + 1000, 4400 - 2400 + 600]
