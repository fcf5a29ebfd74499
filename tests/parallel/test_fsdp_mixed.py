"""Issue 31: a mixed per-block plan (blocks replicated, zero=2 and zero=3, some recomputed, over one
split) trains equal to one process (fp64) with SGD+momentum and AdamW, through hybridpar.parallelize
(honouring the plan's own recomputation) and `hybridpar train --plan`; what a plan cannot mix is refused."""

from __future__ import annotations

import pytest
import torch
from tests.parallel._fsdp_mixed_workers import CHOICE, MixNet, make_model, mixed_plan, run_mixed
from tests.parallel._fsdp_workers import train

from hybridpar.errors import UserError
from hybridpar.layout import LayerLayout


def _err(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)


def test_plan_carries_the_per_block_choice():
    from hybridpar.plans import plan_from_dict

    plan = mixed_plan()
    data = plan.model_dump(mode="json")
    assert data["recompute_blocks"] == ["cells.0", "cells.1"]
    assert data["layers"]["stem.conv"]["zero"] == 3 and "zero" not in data["layers"]["head"]
    assert plan_from_dict(data) == plan
    assert "recompute_blocks" not in plan.model_copy(update={"recompute_blocks": None}).model_dump()
    with pytest.raises(UserError, match="recompute is 'all'"):
        plan_from_dict({**data, "recompute": "all"})


def test_refusals_before_any_rank():
    from hybridpar.parallel.fsdp import sharding_refusal, take_options

    split = {"stem.conv": LayerLayout(sample=2, zero=3), "stem.bn": LayerLayout(sample=2)}
    assert "differ in zero level" in sharding_refusal(list(split.values()), 1, "none", split)
    mixed_split = [LayerLayout(sample=2, zero=3), LayerLayout(channel=2)]
    assert "sample, channel or filter" in sharding_refusal(mixed_split, 1, "none")
    with pytest.raises(UserError, match="bf16"):
        take_options(mixed_plan(), {"mixed_precision": "bf16"}, 2)
    assert take_options(mixed_plan(), {}, 2)[0] == ("cells.0", "cells.1")  # the plan's own choice
    assert take_options(mixed_plan(), {"recompute": "all"}, 2)[0] == "all"  # the caller's option wins


def test_unknown_recompute_block_is_refused():
    from hybridpar.parallel.fsdp import recompute_blocks

    with pytest.raises(UserError, match="no block 'cellz.0'"):
        recompute_blocks(MixNet(), ("cellz.0",))
    m = MixNet()
    assert recompute_blocks(m, ("cells.1",)) == ["cells.1"] and recompute_blocks(m) == list(CHOICE)
    assert recompute_blocks(m) == list(CHOICE)  # wrapped once: asking again changes nothing


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_mixed_plan_equals_one_process_through_parallelize():
    from hybridpar.train.launch import spawn

    got = spawn(run_mixed, 2)
    for opt_name in ("sgd", "adamw"):
        ref = make_model()
        losses = train(ref, opt_name)
        for x in [got[opt_name]]:  # rank 0's (full_state_dict: the same on every rank)
            assert x["sharded"] == x["held"] == ["cells.1", "stem"]  # zero 2|3 blocks only
            assert _err(x["state"], ref.state_dict()) <= 1e-9, opt_name
            assert max(abs(a - b) for a, b in zip(losses, x["losses"])) <= 1e-12
            # 3 steps; 3 of the one-time mixed-sample check (as test_fsdp); the recomputed cells once more per step
            extra = {b: 3 if rec else 0 for b, (_, rec) in CHOICE.items()}
            assert x["calls"] == {b: 3 + 3 + extra[b] for b in CHOICE}, x["calls"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_mixed_plan_equals_one_process_through_train(tmp_path, capsys):
    import json

    from hybridpar.cli.main import main

    plan_file = tmp_path / "mixed.json"
    mixed_plan().save(plan_file)

    def run(*how: str, opt: tuple[str, ...]) -> dict:
        out = tmp_path / f"{len(how)}{opt[0]}.pt"
        code = main(["train", "--model", "tests/parallel/_fsdp_mixed_workers.py:mix_net", "--input-shape", "3,6,6",
                     *how, "--batch", "8", "--steps", "3", "--no-shuffle", "--precision", "fp64", *opt,
                     "--save", str(out), "--json"])
        cap = capsys.readouterr()
        assert code == 0, cap.err
        return torch.load(out, weights_only=True), json.loads(cap.out)

    m = MixNet()
    full = sum(p.numel() for p in m.parameters()) * 8
    # the zero 2|3 blocks (stem, cells.1: even dims) hold half of their parameters on each rank
    halved = sum(p.numel() for b in ("stem", "cells.1") for p in m.get_submodule(b).parameters()) * 8 // 2
    for opt in (("--momentum", "0.9"), ("--optimizer", "adamw", "--weight-decay", "0.01")):
        got, report = run("--plan", str(plan_file), "--nproc", "2", opt=opt)
        want, _ = run("--strategy", "sample=1", "--nproc", "1", opt=opt)
        assert _err(got, want) <= 1e-9, opt
        assert report["param_bytes_per_rank"] == [full - halved] * 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mixed_plan_composed_with_channel_equals_one_process():
    from hybridpar.train.launch import spawn

    got = spawn(run_mixed, 4, {"sample": 2, "channel": 2}, ("adamw",))
    ref = make_model()
    losses = train(ref, "adamw")
    x = got["adamw"]
    assert x["sharded"] == x["held"] == ["cells.1", "stem"]
    assert _err(x["state"], ref.state_dict()) <= 1e-9
    assert max(abs(a - b) for a, b in zip(losses, x["losses"])) <= 1e-12


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_planned_per_block_plan_trains_equal_to_one_process(tmp_path, capsys):
    """The planner under a memory limit between data parallelism's need and full recomputation's writes
    a plan that recomputes some blocks; `hybridpar train --plan` runs it equal to one process."""
    import json

    from hybridpar.cli.main import main
    from hybridpar.search.layers.planner import plan_model

    model = "tests/parallel/_fsdp_mixed_workers.py:act_net"
    free = plan_model(model, "localhost", 2, 8, input_shape=(3, 16, 16))
    dp, every = free.baseline.memory_bytes[0], free.fsdp_baseline.memory_bytes[0]
    limit = int(dp - (dp - every) * 0.2)
    out = tmp_path / "plan.json"
    plan_model(model, "localhost", 2, 8, input_shape=(3, 16, 16), memory_limit=limit).plan.save(out)
    plan = json.loads(out.read_text())
    assert plan.get("recompute") is None and 0 < len(plan["recompute_blocks"]) < 6, plan.get("recompute_blocks")

    def run(*how: str) -> dict:
        save = tmp_path / f"{len(how)}.pt"
        code = main(["train", "--model", model, "--input-shape", "3,16,16", *how, "--batch", "8", "--steps", "2",
                     "--no-shuffle", "--precision", "fp64", "--momentum", "0.9", "--save", str(save), "--json"])
        cap = capsys.readouterr()
        assert code == 0, cap.err
        return torch.load(save, weights_only=True)

    assert _err(run("--plan", str(out), "--nproc", "2"), run("--strategy", "sample=1", "--nproc", "1")) <= 1e-9
