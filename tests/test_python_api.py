"""DESIGN.md's Python API: hybridpar.graph.trace, hybridpar.plan(...), hybridpar.place(...),
hybridpar.runtime.parallelize."""

import hybridpar
from hybridpar.plan import Plan, parse_strategy


def test_plan_package_is_also_the_planner():
    result = hybridpar.plan("small_cnn", "localhost", gpus=2, batch=8)
    assert isinstance(result.plan, Plan)
    assert result.plan.world_size == 2 and result.prediction.step_time_s > 0
    # The package's own names still work after the call.
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
    from hybridpar.runtime import parallelize

    assert callable(parallelize)
