"""One rule for what recomputes (parallel.fsdp.plan_recompute), used by parallelize and `hybridpar train`:
the user's explicit ask (`--recompute all`, recompute="all") wins over the plan's per-block choice; asking
nothing ("none", the CLI's default) runs the plan's "all" or its per-block choice."""

from __future__ import annotations

from tests.parallel._fsdp_mixed_workers import mixed_plan

from hybridpar.parallel.fsdp import plan_recompute, take_options
from hybridpar.plans import Plan

BLOCKS = ("cells.0", "cells.1")


def test_explicit_all_wins_over_the_plans_choice():
    per_block = mixed_plan()
    assert plan_recompute(per_block) == plan_recompute(per_block, "none") == BLOCKS
    assert plan_recompute(per_block, "all") == "all"
    whole = per_block.model_copy(update={"recompute_blocks": None, "recompute": "all"})
    assert plan_recompute(whole, "none") == plan_recompute(whole) == "all"
    # a plan holding both (built without validation): "all", the larger ask, not its blocks
    both = Plan.model_construct(**{**dict(per_block), "recompute": "all"})
    assert plan_recompute(both) == "all"
    assert plan_recompute("sample=2") == "none" and plan_recompute("sample=2", "all") == "all"
    # parallelize's option under the same rule: "none" asks nothing, so the plan's blocks still run
    assert take_options(mixed_plan(), {"recompute": "none"}, 2)[0] == BLOCKS
    assert take_options(mixed_plan(), {"recompute": "all"}, 2)[0] == "all"


def test_train_config_follows_the_rule():
    """run_config's recompute and its memory prediction: --recompute all on a per-block plan is the plan
    with "all"; without it, the plan's blocks (not nothing)."""
    from hybridpar.train.config import run_config

    per_block = mixed_plan()
    model = per_block.model
    asked_all = run_config(plan=per_block, model=model, recompute="all", steps=1)
    plan_all = run_config(plan=per_block.model_copy(update={"recompute_blocks": None, "recompute": "all"}),
                          model=model, steps=1)
    plan_none = run_config(plan=per_block.model_copy(update={"recompute_blocks": None}), model=model, steps=1)
    blocks = run_config(plan=per_block, model=model, steps=1)
    assert asked_all.config.parallel.recompute == plan_all.config.parallel.recompute == "all"
    assert blocks.config.parallel.recompute == "none"  # the blocks stay on the plan: parallelize runs them
    assert asked_all.memory_per_rank == plan_all.memory_per_rank
    assert blocks.memory_per_rank != plan_none.memory_per_rank  # the blocks priced
