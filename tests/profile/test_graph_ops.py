"""`hybridpar profile --model` times every op kind and shape of the model's graph (issue 35 item 1), and
a localhost plan whose op times are the roofline's says so in its table, JSON and report (item 2)."""

import json
import os

import pytest
import torch

from hybridpar.cli.main import main
from hybridpar.cluster.calibration import Calibration, save_calibration
from hybridpar.cost.compute import local_shapes, op_time
from hybridpar.cost.coverage import LABEL
from hybridpar.graph import trace
from hybridpar.profile.graph_ops import profile_graph_ops
from hybridpar.profile.run import ProfileOptions, _model_ops, graph_work, op_specs

HERE = os.path.dirname(__file__)


def _net3d():
    """tests/profile/net3d.py by path (the tests folder is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("net3d", os.path.join(HERE, "net3d.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
NET3D = os.path.join(HERE, "net3d.py") + ":build"
SHAPE = "2,4,8,8"


def _base(ops, untimed=None) -> Calibration:
    """A calibration of this machine holding `ops` (figures other than op times made up: the test is
    about which op times are measured)."""
    return Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10, ops=ops, untimed=untimed or {})


@pytest.mark.timeout(60)
def test_every_op_kind_of_the_graph_is_timed_at_each_split():
    net3d = _net3d()
    for make, kinds in ((net3d.build, {"conv", "batchnorm", "maxpool", "layernorm", "attention", "pointwise", "add",
                                 "relu", "reduce", "linear"}),
                        (net3d.build_tokens, {"embedding", "layernorm", "pointwise", "reduce", "linear"})):
        module, inputs = make()
        graph = trace(module, inputs, train=True)
        records, untimed = profile_graph_ops(module, inputs, graph, (2,), set(), warmup=1, repeats=3)
        assert {r.op for r in records.values()} >= kinds
        assert all(r.fwd.median_s > 0 for r in records.values())
        for r in records.values():  # weights' gradients timed where the op has weights
            if r.op in ("conv", "layernorm", "embedding", "batchnorm"):
                assert r.bwd_weight is not None and r.bwd_weight.median_s > 0, r.key
        cal = _base(records, untimed)
        for n in graph.nodes:  # whole and at sample=2, every working node finds its measured time
            if n.op in ("input", "flatten"):
                continue
            for frac in (1.0, 0.5):
                assert local_shapes(n, frac).key(n.op) in records, (n.name, frac)
                t = op_time(n, _dev(), sample_frac=frac, calibration=cal)
                assert t.source == "measured", (n.name, t)
        # an op at a piece it cannot compute is listed with the reason, never timed wrongly
        assert all(isinstance(v, str) and v for v in untimed.values())


def _dev():
    from hybridpar.cluster import load_cluster

    return load_cluster("localhost", gpus=2).device


def _plan_json(capsys, *extra) -> dict:
    capsys.readouterr()
    rc = main(["plan", "--model", NET3D, "--input-shape", SHAPE, "--gpus", "2", "--batch", "4",
               "--strategy", "sample=2", "--json", *extra])
    assert rc == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.timeout(120)
def test_localhost_plan_labels_roofline_figures_until_the_ops_are_profiled(tmp_path, monkeypatch, capsys):
    from hybridpar.plans.schema import load_plan
    from hybridpar.report.build import build_report

    path = tmp_path / "cal.json"
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(path))
    # no calibration: every figure is labelled, in the table, the JSON and the report
    capsys.readouterr()
    assert main(["plan", "--model", NET3D, "--input-shape", SHAPE, "--gpus", "2", "--batch", "4",
                 "--strategy", "sample=2", "--out", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "UNCALIBRATED ESTIMATE" in out.split("note:")[0]  # the tables' titles, not only the note
    assert f"note: {LABEL}: no calibration file" in out
    assert LABEL in build_report(load_plan(tmp_path / "plan.json")).html
    got = _plan_json(capsys)
    assert got["uncalibrated_estimate"].startswith(LABEL) and got["plan"]["notes"][0].startswith(LABEL)

    # the old fixed list (2-D conv, linear, norms, ReLU, pools): Conv3d, attention, LayerNorm ... named
    opts = ProfileOptions(model=NET3D, batch=4, input_shape=(2, 4, 8, 8), splits=(2,), warmup=1, repeats=3)
    specs = op_specs(opts)
    hooked, _ = _model_ops(opts, specs, None, lambda desc: None)
    save_calibration(_base(hooked), path)
    note = _plan_json(capsys)["uncalibrated_estimate"]
    for kind in ("conv x1", "attention x1", "layernorm x1", "pointwise x1", "maxpool x1", "batchnorm x1"):
        assert kind in note, note
    assert "--splits 2" in note

    # profiled as `hybridpar profile --model` now does: every op time of the plan is measured, no label
    steps = []
    records, untimed = _model_ops(opts, specs, graph_work(opts, {s.key for s in specs}), steps.append)
    assert len(steps) > len(specs)  # progress for each op of the graph too
    save_calibration(_base(records, untimed), path)
    got = _plan_json(capsys)
    assert got["uncalibrated_estimate"] is None
    assert not any(n.startswith(LABEL) for n in got["plan"]["notes"])
    # bf16: the op table is fp32's, so the plan is the roofline's again, and says why
    assert "fp32" in _plan_json(capsys, "--dtype", "bf16")["uncalibrated_estimate"]


def test_a_gpu_preset_plan_carries_no_label(capsys):
    got = json.loads((main(["plan", "--model", "small_cnn", "--cluster", "lassen", "--gpus", "2", "--batch", "8",
                            "--json"]), capsys.readouterr().out)[1])
    assert got["uncalibrated_estimate"] is None


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
