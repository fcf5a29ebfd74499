"""benchmarks/bench_memory_fsdp.py (issue 31): its acceptance logic, and one small model's FSDP row
predicted against measured through the benchmark's own run (`hybridpar train --json`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_memory_fsdp as bench  # noqa: E402

MiB = 2**20


def _row(model, layout, predicted, peak, new=True):
    err = peak / predicted - 1
    return {"model": model, "layout": layout, "new": new, "predicted_bytes": predicted, "peak_bytes": peak,
            "rel_error": err, "within_tolerance": abs(err) <= bench.TOLERANCE}


def test_acceptance_lines_say_met_and_not_met():
    rows = [_row("wide_cnn", "data parallelism (sample=2)", 1000 * MiB, 950 * MiB, False),
            _row("wide_cnn", "sample=2,zero=3", 700 * MiB, 720 * MiB),
            _row("wide_cnn", "channel/filter (channel=2)", 650 * MiB, 640 * MiB, False),
            {"model": "wide_cnn", "limit_bytes": 800 * MiB},
            _row("act_cnn", "data parallelism (sample=2)", 900 * MiB, 880 * MiB, False),
            _row("act_cnn", "sample=2 + recompute all", 600 * MiB, 590 * MiB)]
    lines = bench.acceptance(rows)
    assert lines[0].startswith("every new layout's measured peak within 15% of predicted: met")
    assert "predicted 300 MiB, measured 290 MiB" in lines[1] and lines[1].endswith("met (within 20%)")
    assert lines[2].endswith(": met") and "does not fit" in lines[2]
    rows[1] = _row("wide_cnn", "sample=2,zero=3", 700 * MiB, 900 * MiB)  # over the limit, 29% over
    lines = bench.acceptance(rows)
    assert "NOT MET" in lines[0] and lines[2].endswith("NOT MET")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero3_row_predicts_the_sharded_state_and_measures_near_it():
    from hybridpar.cost.memory import predict_rank_memory
    from hybridpar.search.graph_cache import traced_graph

    model = "wide_cnn_quick"
    _, shape, batch = bench.MODELS[model]
    z3 = bench.train(model, ["--strategy", "sample=2,zero=3"], 2)
    graph, _ = traced_graph(f"{bench.MODEL_FILE}:{model}", tuple(int(x) for x in shape.split(",")))
    rule = {s: predict_rank_memory(graph, s, batch=batch, optimizer="adamw").total_bytes
            for s in ("sample=2", "sample=2,zero=3")}
    saved = rule["sample=2"] - rule["sample=2,zero=3"]
    assert saved > 5 * MiB
    # the run reports against the zero=3 rule (plus the data set held whole: a few batches here)
    assert 0 <= z3["plan_predicted_bytes"] - rule["sample=2,zero=3"] < saved / 2
    # the benchmark states it with this machine's framework constant in place of the plan's
    assert z3["predicted_bytes"] - z3["plan_predicted_bytes"] == bench.FRAMEWORK["measured"] - bench.FRAMEWORK["plan"]
    # measured: within 35% here (at this size the framework's bytes dominate, and its measurement's
    # spread; the benchmark's full rows state the 15% check)
    assert all(abs(p / z3["predicted_bytes"] - 1) <= 0.35 for p in z3["peaks"]), z3
