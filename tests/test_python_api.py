"""DESIGN.md's Python API: hybridpar.graph.trace, hybridpar.plan(...), hybridpar.place(...),
hybridpar.parallel.parallelize."""

import hybridpar
from hybridpar.plans import Plan, parse_strategy


def test_plan_runs_the_planner():
    result = hybridpar.plan("small_cnn", "localhost", gpus=2, batch=8)
    assert isinstance(result.plan, Plan)
    assert result.plan.world_size == 2 and result.prediction.step_time_s > 0
    # The Plan package's names work beside the function.
    assert parse_strategy("sample=2").layout.sample == 2


def test_place_and_trace():
    from hybridpar.graph import load_model, trace

    loaded = load_model("inception_mini", batch=4)
    graph = trace(loaded.module, loaded.example_inputs)
    assert graph.fwd_flops > 0 and len(graph) > 5
    out = hybridpar.place("inception_mini", "dgx1-v100", devices=2, solver="etf", batch=4)
    assert out.plan.mp == 2 and set(out.plan.placement.values()) <= {0, 1}
    assert out.result.step_time_s > 0


def test_parallelize_is_exported():
    from hybridpar.parallel import parallelize

    assert callable(parallelize)


def test_api_names_are_plain_functions():
    import inspect

    import hybridpar.graph.tracing
    import hybridpar.parallel.api  # nor the runtime's module the function
    import hybridpar.plans  # importing the Plan package must not shadow the function

    assert inspect.isfunction(hybridpar.plan) and inspect.isfunction(hybridpar.place)
    assert inspect.isfunction(hybridpar.parallelize) and inspect.isfunction(hybridpar.full_state_dict)
    assert inspect.isfunction(hybridpar.parallel.parallelize) and inspect.isfunction(hybridpar.graph.trace)
    from pathlib import Path

    assert not (Path(hybridpar.__file__).parent / "_callable.py").exists()


def test_plan_takes_a_module_and_a_cluster_object():
    import pytest
    import torch
    from torch import nn

    from hybridpar.cluster import load_cluster
    from hybridpar.errors import UserError

    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    x = torch.randn(2, 3, 8, 8)
    result = hybridpar.plan(net, load_cluster("localhost", gpus=2), gpus=2, batch=8, example_inputs=x)
    assert result.plan.world_size == 2 and result.plan.batch == 8
    assert result.plan.model == "Sequential" and result.plan.input_shape == [3, 8, 8]
    assert result.prediction.step_time_s > 0
    by_name = hybridpar.plan("small_cnn", "localhost", gpus=2, batch=8)
    assert by_name.plan.cluster == result.plan.cluster
    with pytest.raises(UserError, match="example_inputs"):
        hybridpar.plan(net, "localhost", gpus=2, batch=8)


def test_place_takes_a_module_and_a_cluster_object():
    import torch
    from torch import nn

    from hybridpar.cluster import load_cluster

    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    out = hybridpar.place(net, load_cluster("dgx1-v100", 2), devices=2, solver="etf", batch=8,
                          example_inputs=torch.randn(8, 64))
    assert out.plan.mp == 2 and set(out.plan.placement.values()) <= {0, 1}
    assert out.plan.cluster == "dgx1-v100" and out.result.step_time_s > 0
