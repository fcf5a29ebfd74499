"""The search takes config objects (PlannerConfig, PlacerConfig) or their fields as keywords, one default
cluster (localhost) and `train`'s optimizer vocabulary (the cost model's old names still accepted)."""

from __future__ import annotations

import json

import pytest

import hybridpar
from hybridpar.errors import UserError
from hybridpar.search.layers.planner import PlannerConfig, plan_model
from hybridpar.search.placer.api import build_problem, place_model
from hybridpar.search.placer.config import PlacerConfig


def test_plan_takes_a_config_or_its_keywords():
    by_keywords = plan_model("small_cnn", "localhost", 2, 8, strategy="sample=2", optimizer="sgd", momentum=0.9)
    by_config = plan_model("small_cnn", "localhost", 2, 8, PlannerConfig(strategy="sample=2", momentum=0.9))
    assert by_config.prediction == by_keywords.prediction
    over = hybridpar.plan("small_cnn", "localhost", 2, 8, PlannerConfig(strategy="sample=2"), momentum=0.9)
    assert over.prediction == by_keywords.prediction  # keywords over a config
    with pytest.raises(TypeError, match="memory_limt"):
        plan_model("small_cnn", "localhost", 2, 8, memory_limt=1)


def test_place_takes_a_config_its_keywords_and_the_old_device_name():
    cfg = PlacerConfig(solver="greedy", batch=8)
    a = place_model("small_cnn", "localhost", 2, cfg)
    b = hybridpar.place("small_cnn", "localhost", devices=2, solver="greedy", batch=8)
    assert a.result.step_time_s == b.result.step_time_s and a.plan.mp == b.plan.mp == 2


def test_one_default_cluster():
    assert place_model("small_cnn", solver="greedy").plan.cluster == "localhost"
    assert hybridpar.place("small_cnn", solver="greedy").plan.cluster == "localhost"


def test_trains_optimizer_words_and_the_old_names_price_the_same():
    def priced(**kw):
        prob, *_ = build_problem("small_cnn", "localhost", 2, batch=8, **kw)
        return prob.update_call_s, [t.mem_bytes for t in prob.tasks], [t.bwd_s for t in prob.tasks]

    assert priced(optimizer="sgd", momentum=0.9) == priced(optimizer="momentum")
    assert priced(optimizer="sgd") != priced(optimizer="momentum")
    assert priced(optimizer="adam")[1] == priced(optimizer="adamw")[1]  # two moments each
    with pytest.raises(UserError, match="momentum must be >= 0"):
        priced(optimizer="sgd", momentum=-1.0)


def test_cli_place_takes_trains_words(capsys):
    from hybridpar.cli.main import main

    runs = []
    for flags in (["--optimizer", "sgd", "--momentum", "0.9"], ["--optimizer", "momentum"]):
        assert main(["place", "--model", "small_cnn", "--gpus", "2", "--solver", "greedy", "--json", *flags]) == 0
        out = json.loads(capsys.readouterr().out)
        runs.append((out["step_time_s"], out["memory_bytes"]))
    assert runs[0] == runs[1]
