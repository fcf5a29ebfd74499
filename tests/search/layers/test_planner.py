"""`hybridpar plan` and plan_model(): the Plan it writes, --strategy, memory limits, bad input."""

from __future__ import annotations

import json

import pytest

from hybridpar.cli.main import main
from hybridpar.plans import load_plan
from hybridpar.search.layers.planner import plan_model


@pytest.fixture(autouse=True, scope="module")
def _graph_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("HYBRIDPAR_CACHE", str(tmp_path_factory.mktemp("graphs")))
    yield
    mp.undo()


def _module_names():
    from hybridpar.graph.zoo import ZOO

    return {n for n, _ in ZOO["small_resnet"].build().named_modules()}


def test_plan_cli_writes_a_runnable_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "small_resnet", "--cluster", "localhost", "--gpus", "4", "--batch", "16",
                 "--out", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    plan = load_plan(out)
    assert plan.world_size == 4 and plan.mp == 1 and plan.batch == 16
    assert plan.predicted is not None and plan.predicted.step_time_s > 0
    assert set(plan.layers) <= _module_names() and "fc" in plan.layers
    assert len({lay.sample for lay in plan.layers.values()}) == 1  # the runtime's S x G grid
    assert data["speedup_vs_dp"] >= 1.0 - 1e-9  # never predicted slower than data parallelism
    assert {row["module"] for row in data["layers"] if row["algorithm"] != "join"} == set(plan.layers)


def test_table_output_names_layers_and_compares_with_dp(capsys):
    assert main(["plan", "--model", "small_resnet", "--gpus", "2", "--batch", "8"]) == 0
    text = capsys.readouterr().out
    assert "layers.0.conv1" in text and "data parallel" in text and "speedup over data parallelism" in text


def test_strategy_is_evaluated_not_searched():
    dp = plan_model("small_resnet", "localhost", 4, 16, strategy="sample=4")
    cf = plan_model("small_resnet", "localhost", 4, 16, strategy="sample=2,channel=2")
    assert dp.prediction.step_time_s == pytest.approx(dp.baseline.step_time_s)
    assert all(lay.channel == 2 and lay.sample == 2 for lay in cf.plan.layers.values())
    assert cf.plan.strategy == "sample=2,channel=2"
    # channel parallelism halves each rank's conv weights, so it needs less parameter memory
    assert cf.prediction.comm_bytes.get("reduce_scatter", 0) > 0
    best = plan_model("small_resnet", "localhost", 4, 16)
    assert best.prediction.step_time_s <= min(dp.prediction.step_time_s, cf.prediction.step_time_s) + 1e-12


def test_memory_limit_forces_channel_filter_when_dp_does_not_fit():
    free = plan_model("resnet50", "lassen", 8, 8)
    dp_mem = free.baseline.memory_bytes[0]
    limit = 0.8 * dp_mem
    res = plan_model("resnet50", "lassen", 8, 8, memory_limit=limit)
    assert res.baseline is None and "over the" in res.baseline_note
    assert res.prediction.memory_bytes[0] <= limit
    assert any(lay.channel * lay.filter > 1 for lay in res.plan.layers.values())


def test_infeasible_memory_and_bad_input_exit_2(capsys):
    assert main(["plan", "--model", "small_resnet", "--gpus", "2", "--batch", "8", "--memory-limit", "1KiB"]) == 2
    assert "no decomposition" in capsys.readouterr().err
    for bad in (["--gpus", "0"], ["--memory-limit", "lots"], ["--strategy", "mp=2,sample=1"],
                ["--strategy", "sample=3"], ["--model", "nonexistent"]):
        args = {"--model": "small_resnet", "--gpus": "2", "--batch": "8"}
        args.update(dict(zip(bad[::2], bad[1::2])))
        argv = ["plan"] + [x for kv in args.items() for x in kv]
        assert main(argv) == 2, bad
        err = capsys.readouterr().err
        assert err.startswith("hybridpar: error:") and "Traceback" not in err


def test_free_sample_space_is_searched_with_redistribution():
    free = plan_model("small_resnet", "localhost", 4, 16, free_sample=True)
    assert free.prediction.step_time_s <= free.baseline.step_time_s * (1 + 1e-9)
    samples = {lay.sample for lay in free.plan.layers.values()}
    assert samples <= {1, 2, 4}
    if len(samples) > 1:
        assert any("different sample degrees" in n for n in free.plan.notes)


@pytest.mark.parametrize("strategy", ["sample=4", "sample=2,channel=2", "sample=2,filter=2", "channel=2,filter=2",
                                      "channel=4"])
def test_predicted_bytes_equal_the_runtimes_analytic_bytes(strategy):
    """Per kind, the bytes the prediction prices are those hybridpar.parallel issues (layout_comm, its twin)."""
    from hybridpar.cost.layout_comm import bytes_by_kind, model_collectives
    from hybridpar.plans import parse_strategy
    from hybridpar.search.layers.planner import _scaled, _traced

    res = plan_model("small_resnet", "localhost", 4, 16, strategy=strategy)
    graph = _scaled(_traced("small_resnet", None)[0], 16)
    expected = bytes_by_kind(model_collectives(graph, parse_strategy(strategy, 4).layout))
    assert {k: v for k, v in res.prediction.comm_bytes.items() if v} == expected


def test_evaluate_plan_reproduces_the_plans_prediction_and_scales_with_time_share():
    from hybridpar.search.layers.planner import evaluate_plan

    res = plan_model("small_resnet", "localhost", 4, 16, strategy="sample=2,filter=2")
    assert evaluate_plan(res.plan).step_time_s == pytest.approx(res.prediction.step_time_s)
    slower, slow = evaluate_plan(res.plan, time_share=8.0), evaluate_plan(res.plan, time_share=4.0)
    assert slower.compute_s == pytest.approx(2 * slow.compute_s, rel=1e-9)  # compute scales with the share
    assert slower.comm_s == pytest.approx(slow.comm_s, rel=1e-9)
