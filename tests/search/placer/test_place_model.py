"""place_model / `hybridpar place` on real zoo graphs and cluster presets, and the hybrid step model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.fx

from hybridpar.cli.main import main
from hybridpar.cluster import load_cluster
from hybridpar.cost.compute import op_time
from hybridpar.cost.memory import training_memory
from hybridpar.cost.update import step_work
from hybridpar.graph.models import load_model
from hybridpar.plans import load_plan
from hybridpar.search.placer import place_model
from hybridpar.search.placer.api import build_problem
from hybridpar.search.placer.hybrid_step import hybrid_step_time

PRESET = Path(__file__).resolve().parents[3] / "src/hybridpar/cluster/presets/dgx1-v100.yaml"


def small_cluster(tmp_path: Path, memory_bytes: float) -> str:
    """dgx1-v100 with `memory_bytes` per GPU (a test cluster whose devices are tiny)."""
    text = PRESET.read_text()
    assert "value: 16.0e9" in text
    path = tmp_path / "tiny.yaml"
    path.write_text(text.replace("value: 16.0e9", f"value: {memory_bytes:.6e}", 1))
    return str(path)


def test_problem_totals_match_the_cost_model():
    prob, coarse, fine, cl, _ = build_problem("inception_mini", "dgx1-v100", 2, batch=8, coarsen=10)
    assert len(coarse) <= 10 < len(fine)
    assert sum(t.mem_bytes for t in prob.tasks) == pytest.approx(training_memory(fine).total_bytes, rel=1e-9)
    fwd = sum(op_time(n, cl).fwd_s for n in fine.nodes)
    loss = step_work(cl, "momentum").loss_s(sum(fine.node(o).out_numel for o in fine.outputs))
    assert loss > 0
    assert sum(t.fwd_s[0] for t in prob.tasks) == pytest.approx(fwd + loss, rel=1e-9)
    assert prob.links[0][1] == cl.links_between(0, 1)
    assert sum(t.grad_bytes for t in prob.tasks) == 4 * fine.params


def test_cli_place_writes_plan_and_gantt(tmp_path, capsys):
    plan_path, png = tmp_path / "plan.json", tmp_path / "g.png"
    rc = main(["place", "--model", "inception_mini", "--devices", "2", "--batch", "16", "--coarsen", "12",
               "--time-limit", "10", "--workers", "1", "--out", str(plan_path), "--gantt", str(png), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["solver"] == "ilp" and out["gap"] is not None
    assert out["speedup"] >= 1 - 1e-9  # the ILP starts from the best baseline, one device among them
    assert all(out["step_time_s"] <= v * (1 + 1e-9) for v in out["baselines"].values())
    assert out["step_time_s"] == pytest.approx(out["compute_s"] + out["exposed_comm_s"])
    plan = load_plan(plan_path)
    assert plan.mp == 2 and plan.dp == 1 and plan.predicted.step_time_s == pytest.approx(out["step_time_s"])
    module = load_model("inception_mini").module
    modules = dict(module.named_modules())
    fx_nodes = {n.name for n in torch.fx.symbolic_trace(module).graph.nodes}
    assert plan.placement and set(plan.placement) <= set(modules) | fx_nodes
    # the nodes no module runs (branch concats) are placed by their fx node name
    assert any(k.startswith("cat") for k in plan.placement) and set(plan.placement) & fx_nodes - set(modules)
    assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("solver", ["dp", "etf", "greedy", "single"])
def test_cli_baseline_solvers(solver, capsys):
    assert main(["place", "--model", "small_cnn", "--devices", "2", "--solver", solver, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["solver"] == solver and out["gap"] is None and out["step_time_s"] > 0


def test_model_too_big_for_one_device_gets_a_fitting_placement(tmp_path, capsys):
    prob, *_ = build_problem("inception_mini", "dgx1-v100", 2, batch=64, coarsen=12)
    need, biggest = sum(t.mem_bytes for t in prob.tasks), max(t.mem_bytes for t in prob.tasks)
    cap = max(0.6 * need, biggest * 1.05)
    assert cap < need
    cluster = small_cluster(tmp_path, cap)
    out = place_model("inception_mini", cluster, 2, batch=64, coarsen=12, time_limit_s=10, workers=1)
    assert not out.single_fits and "single" not in out.baselines
    assert out.result.devices_used == 2
    assert all(m <= load_cluster(cluster, 2).device.memory_bytes for m in out.result.memory_bytes)
    rc = main(["place", "--model", "inception_mini", "--cluster", cluster, "--devices", "2", "--batch", "64",
               "--coarsen", "12", "--solver", "single"])
    assert rc == 2 and "on one device" in capsys.readouterr().err


def test_infeasible_memory_is_one_line_naming_the_bottleneck(tmp_path, capsys):
    cluster = small_cluster(tmp_path, 1e5)
    rc = main(["place", "--model", "small_cnn", "--cluster", cluster, "--devices", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "alone needs" in err and "Traceback" not in err


@pytest.mark.parametrize("args", [["--devices", "0"], ["--cluster", "dgx1-v100", "--devices", "99"],
                                  ["--solver", "magic"],
                                  ["--coarsen", "1"], ["--time-limit", "0"], ["--batch", "0"]])
def test_bad_input_exits_2(args, capsys):
    assert main(["place", "--model", "small_cnn", *args]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_hybrid_step_model():
    one = hybrid_step_time("inception_mini", "dgx1-v100", 1, 2, 16, coarsen=10, time_limit_s=5)
    assert one.step_time_s == one.mp_step_s and one.exposed_allreduce_s == 0
    h = hybrid_step_time("inception_mini", "dgx1-v100", 4, 2, 16, coarsen=10, time_limit_s=5)
    assert h.mp_step_s == one.mp_step_s and h.global_batch == 64
    assert h.allreduce_s > 0
    # overlap with backward can hide allreduce, never add to it
    assert h.mp_step_s <= h.step_time_s <= h.mp_step_s + h.allreduce_s + 1e-12
    # DP only (M = 1): the whole model's gradients on one device per replica
    dp = hybrid_step_time("inception_mini", "dgx1-v100", 8, 1, 16, coarsen=10)
    single = place_model("inception_mini", "dgx1-v100", 1, batch=16, coarsen=10, solver="single")
    assert dp.mp_step_s == pytest.approx(single.result.step_time_s) and dp.allreduce_s > 0


def test_hybrid_step_times_a_given_placement():
    out = place_model("inception_mini", "dgx1-v100", 2, batch=16, coarsen=10, time_limit_s=5, workers=1)
    h = hybrid_step_time("inception_mini", "dgx1-v100", 2, 2, 16, coarsen=10, placement=out.plan.placement)
    assert h.mp_step_s == pytest.approx(out.result.step_time_s, rel=1e-9)
    everything_on_0 = {k: 0 for k in out.plan.placement}
    h0 = hybrid_step_time("inception_mini", "dgx1-v100", 2, 2, 16, coarsen=10, placement=everything_on_0)
    # the MP runtime's loss allreduce is the only difference from one process (no executor cost on GPUs)
    assert out.problem.step_overhead_s > 0 and all(t.overhead_s == 0 for t in out.problem.tasks)
    assert h0.mp_step_s == pytest.approx(out.single_step_s + out.problem.step_overhead_s, rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4])
def test_inception_v3_places_on_dgx1_and_reports_gap(devices):
    out = place_model("inception_v3", "dgx1-v100", devices, time_limit_s=10, workers=2)  # the gap, not its size
    assert out.result.gap is not None and 0 <= out.result.gap < 1
    assert all(out.result.step_time_s <= v * (1 + 1e-9) for v in out.baselines.values())
    assert out.speedup > 1


def test_plan_placement_is_accepted_by_the_mp_runtime():
    import hybridpar.parallel.pipeline.partition as partition
    out = place_model("inception_mini", "dgx1-v100", 2, batch=16, coarsen=12, time_limit_s=5, workers=1)
    assert set(out.plan.placement.values()) == {0, 1}  # the branches are split: both devices work
    part = partition.partition_module(load_model("inception_mini").module, out.plan.placement, 2)
    # every fine node runs where the placer put its coarse node, concats included
    device_of = {x: d for n, d in zip(out.graph.nodes, out.result.assignment) for x in n.attr("members") or (n.name,)}
    placed = {k: v for k, v in part.device_of.items() if k in device_of and v is not None}
    assert placed and all(v == device_of[k] for k, v in placed.items())


def test_package_level_place_api():
    import hybridpar

    out = hybridpar.place("small_cnn", "dgx1-v100", 2, solver="greedy")
    assert out.plan.mp == 2 and out.result.solver == "greedy" and out.speedup > 0
