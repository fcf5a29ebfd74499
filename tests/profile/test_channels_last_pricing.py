"""Channels-last priced as it runs (issue 34 item 2): `hybridpar profile --channels-last` records the
model's 4-D ops in that format under their own keys, `plan --channels-last` prices from them (and says
where it could not), a flatten of a channels-last activation is priced as the copy it is, and `train
--channels-last` says whether its plan priced the format."""

import json
import os

import pytest
import torch

from hybridpar.cli.main import main
from hybridpar.cluster import load_cluster
from hybridpar.cluster.calibration import Calibration, save_calibration
from hybridpar.cost.compute import channels_last_layout, format_copy_time, local_shapes, op_time
from hybridpar.graph import trace
from hybridpar.graph.models import load_model
from hybridpar.graph.types import Node
from hybridpar.profile.run import ProfileOptions, model_ops

FLAT_CNN = os.path.join(os.path.dirname(__file__), "flat_cnn.py") + ":build"
PATCH_NET = os.path.join(os.path.dirname(__file__), "flat_cnn.py") + ":build_patch"
IMAGE_OPS = {"conv2d", "batchnorm", "batchnorm_global", "relu", "maxpool", "adaptive_avgpool"}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def records():
    """small_cnn's op records, NCHW and channels-last, as `hybridpar profile --channels-last` times them."""
    torch.set_num_threads(1)
    got, untimed = model_ops(ProfileOptions(model="small_cnn", batch=4, warmup=1, repeats=6, channels_last=True))
    assert not untimed
    return got


def _cal(ops) -> Calibration:
    """A calibration of this machine holding `ops` (device figures made up: the test is about op times)."""
    return Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10, ops=ops)


def _plan(capsys, monkeypatch, tmp_path, ops, *extra, model="small_cnn") -> dict:
    path = tmp_path / "cal.json"
    save_calibration(_cal(ops), path)
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(path))
    capsys.readouterr()
    assert main(["plan", "--model", model, "--gpus", "1", "--batch", "4", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_profile_records_the_4d_ops_channels_last_under_their_own_keys(records):
    cl = {r.op for r in records.values() if r.op.endswith("#cl")}
    assert cl == {f"{op}#cl" for op in IMAGE_OPS}  # the Linear (2-D) is not timed in another format
    for r in records.values():
        assert r.key.split("|", 1)[0] == r.op and r.fwd.median_s > 0 and r.bwd_data.median_s > 0
        if r.op.endswith("#cl"):  # the same shapes as an NCHW record: only the format differs
            assert r.key.replace("#cl|", "|", 1) in records
    # the NCHW records keep their keys (older calibration files and plans without the option)
    assert {r.op for r in records.values() if "#" not in r.op} == IMAGE_OPS | {"linear"}


def test_plan_prices_4d_ops_from_the_channels_last_records(records, capsys, monkeypatch, tmp_path):
    nchw = _plan(capsys, monkeypatch, tmp_path, records)
    cl = _plan(capsys, monkeypatch, tmp_path, records, "--channels-last")
    assert nchw["channels_last"] is None and "channels_last" not in nchw["plan"]
    assert cl["channels_last"] == cl["plan"]["channels_last"] == "measured"
    assert cl["channels_last_note"].startswith("channels-last: all 15 4-D op(s) priced from channels-last")
    # the prediction moves by exactly the measured difference of each 4-D op (one rank: whole shapes)
    m = load_model("small_cnn", batch=4)
    g = trace(m.module, m.example_inputs)
    dev = load_cluster("localhost", gpus=1, calibration=tmp_path / "cal.json").device
    diff = 0.0
    for n in g.nodes:
        if n.op not in IMAGE_OPS:
            continue
        key = local_shapes(n).key(n.op)
        a, b = records[key], records[key.replace("|", "#cl|", 1)]
        first = n.op == "conv2d" and n.bwd_data_flops == 0  # the first conv: autograd skips its dx

        def total(r, skip_dx=first):
            return r.fwd.median_s + (0 if skip_dx else r.bwd_data.median_s) + (r.bwd_weight.median_s
                                                                               if r.bwd_weight else 0)
        diff += (total(b) - total(a)) * dev.time_share
        t = op_time(n, dev, calibration=_cal(records), memory_format="channels_last")
        assert t.source == "measured" and not t.as_nchw
    assert diff != 0
    got = cl["predicted"]["compute_s"] - nchw["predicted"]["compute_s"]
    assert got == pytest.approx(diff, rel=1e-6, abs=1e-12)
    assert cl["predicted"]["step_time_s"] - nchw["predicted"]["step_time_s"] == pytest.approx(diff, rel=1e-6)
    # Python's hybridpar.plan takes the same option (PlannerConfig.channels_last) and predicts the same
    import hybridpar

    res = hybridpar.plan("small_cnn", "localhost", 1, 4, channels_last=True)
    assert res.plan.channels_last == "measured"
    assert res.prediction.step_time_s == pytest.approx(cl["predicted"]["step_time_s"], rel=1e-12)


def test_plan_without_channels_last_records_labels_the_figures(records, capsys, monkeypatch, tmp_path):
    nchw_only = {k: r for k, r in records.items() if "#cl" not in r.op}
    nchw = _plan(capsys, monkeypatch, tmp_path, nchw_only)
    got = _plan(capsys, monkeypatch, tmp_path, nchw_only, "--channels-last")
    assert got["channels_last"] == "nchw-priced"
    note = got["channels_last_note"]
    assert note.startswith("channels-last: 15 of 15 4-D op(s) priced as NCHW, uncalibrated for that format")
    assert "relu x4" in note and "--model small_cnn --batch 4 --splits 1 --channels-last" in note
    assert got["predicted"]["step_time_s"] == nchw["predicted"]["step_time_s"]  # priced as NCHW, said so
    # some records in the format: the rest are named
    partly = {k: r for k, r in records.items() if r.op != "relu#cl"}
    got = _plan(capsys, monkeypatch, tmp_path, partly, "--channels-last")
    assert got["channels_last"] == "partly-measured"
    assert got["channels_last_note"].startswith("channels-last: 4 of 15 4-D op(s) priced as NCHW")
    # the table shows the note too
    capsys.readouterr()
    assert main(["plan", "--model", "small_cnn", "--gpus", "1", "--batch", "4", "--channels-last"]) == 0
    assert "note: channels-last: 4 of 15 4-D op(s) priced as NCHW" in capsys.readouterr().out


def test_a_gpu_preset_prices_channels_last_as_nchw_and_says_so(capsys):
    argv = ["plan", "--model", "small_cnn", "--cluster", "dgx-h100", "--gpus", "2", "--batch", "8", "--json"]
    nchw = json.loads((main(argv), capsys.readouterr().out)[1])
    got = json.loads((main([*argv, "--channels-last"]), capsys.readouterr().out)[1])
    assert got["channels_last"] == "nchw-priced"
    assert "there are no channels-last measurements for" in got["channels_last_note"]
    assert got["predicted"]["step_time_s"] == nchw["predicted"]["step_time_s"]


def _graph(spec, shape):
    m = load_model(spec, batch=4, input_shape=shape)
    return trace(m.module, m.example_inputs)


def test_where_a_channels_last_run_computes_nhwc_and_where_it_copies(tmp_path):
    # small_cnn: every 4-D op NHWC; the flatten after the global pooling (1 x 1) is free in both orders
    g = _graph("small_cnn", None)
    lay = channels_last_layout(g)
    assert {g.node(n).op for n in lay.image} == {"conv2d", "batchnorm", "relu", "maxpool", "adaptive_avgpool"}
    assert not lay.copies
    # a flatten of an 8 x 8 activation, as a copy; an attention's 4-D heads are not images
    g = _graph(FLAT_CNN, (3, 16, 16))
    assert [g.node(n).op for n in channels_last_layout(g).copies] == ["flatten"]
    assert channels_last_layout(g).copies[next(iter(channels_last_layout(g).copies))] == 4 * 8 * 8 * 8
    path = tmp_path / "cal.json"
    save_calibration(_cal({}), path)
    dev = load_cluster("localhost", gpus=1, calibration=path).device
    flat = Node(name="f", op="flatten", in_shapes=((4, 16, 8, 8),), out_shape=(4, 1024))
    copy = 2 * 4 * 16 * 8 * 8 * 4 / dev.mem_bw_Bps * dev.time_share  # fp32 bytes read + written
    t = format_copy_time(flat, 4 * 16 * 8 * 8, dev, "fp32")
    assert (t.fwd_s, t.bwd_data_s, t.source) == (pytest.approx(copy), pytest.approx(copy), "layout-copy")
    assert format_copy_time(flat, 4 * 16 * 8 * 8, dev, "fp32", sample_frac=0.5).fwd_s == pytest.approx(copy / 2)


def test_a_transformers_4d_heads_are_not_images():
    # the patch embedding runs channels-last and is read back in token order (a copy); the attention's
    # 4-D heads come from a Linear: PyTorch's own layout, priced from the NCHW records
    g = _graph(PATCH_NET, (3, 16, 16))
    lay = channels_last_layout(g)
    assert {g.node(n).op for n in lay.image} == {"conv2d"}
    assert list(lay.copies.values()) == [4 * 8 * 4 * 4]
    # a view folded into the Linear after it: the copy is the Linear's
    g = _graph(PATCH_NET.replace(":build_patch", ":build_view"), (3, 16, 16))
    lay = channels_last_layout(g)
    assert {g.node(n).op: v for n, v in lay.copies.items()} == {"linear": 4 * 8 * 16 * 16}


def test_a_plan_prices_the_copy_and_names_it(capsys, monkeypatch, tmp_path):
    path = tmp_path / "cal.json"
    save_calibration(_cal({}), path)
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(path))
    argv = ["plan", "--model", FLAT_CNN, "--input-shape", "3,16,16", "--gpus", "1", "--batch", "4", "--json"]
    nchw = json.loads((main(argv), capsys.readouterr().out)[1])
    got = json.loads((main([*argv, "--channels-last"]), capsys.readouterr().out)[1])
    assert "1 layout conversion copy (a channels-last activation read in NCHW order: " in got["channels_last_note"]
    dev = load_cluster("localhost", gpus=1, calibration=path).device
    copy = 2 * 2 * 4 * 8 * 8 * 8 * 4 / dev.mem_bw_Bps * dev.time_share  # fwd + bwd of the 4 x 8 x 8 x 8 activation
    assert got["predicted"]["step_time_s"] - nchw["predicted"]["step_time_s"] == pytest.approx(copy, rel=1e-6)


def test_bad_combinations_exit_2_with_one_line(capsys):
    assert main(["profile", "--model", "", "--channels-last"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--channels-last" in err and "model" in err
    assert main(["plan", "--model", "lstm2", "--gpus", "1", "--batch", "4", "--channels-last"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no 4-D" in err


def test_train_says_whether_the_plan_priced_the_format():
    from hybridpar.plans import Plan
    from hybridpar.plans.schema import Prediction
    from hybridpar.train.config import channels_last_note

    pred = Prediction(step_time_s=1.0)
    plan = Plan(model="small_cnn", world_size=1, batch=4, predicted=pred)
    assert channels_last_note(plan, False) is None
    assert "NCHW's (planned without --channels-last" in channels_last_note(plan, True)
    measured = plan.model_copy(update={"channels_last": "measured"})
    assert "priced it from channels-last op times measured on localhost" in channels_last_note(measured, True)
    assert "this run is NCHW" in channels_last_note(measured, False)
    gpu = plan.model_copy(update={"channels_last": "nchw-priced", "cluster": "dgx-h100"})
    assert "as NCHW (no channels-last measurements for dgx-h100" in channels_last_note(gpu, True)
    # the field round-trips through the plan file and is absent from a plan that does not set it
    assert Plan.model_validate_json(measured.model_dump_json()).channels_last == "measured"
    assert "channels_last" not in json.loads(plan.model_dump_json())


def test_bf16_records_are_timed_under_autocast_and_priced_by_a_bf16_plan(capsys, monkeypatch, tmp_path):
    got, untimed = model_ops(ProfileOptions(model="small_cnn", batch=4, warmup=1, repeats=3, precision="bf16",
                                            channels_last=True))
    assert not untimed
    ops = {r.op for r in got.values()}
    assert {f"{op}#bf16" for op in IMAGE_OPS | {"linear"}} <= ops
    assert {f"{op}#cl#bf16" for op in IMAGE_OPS} <= ops
    fp32 = {k: r for k, r in got.items() if "#bf16" not in r.op}
    # a bf16 plan against fp32 records only: the roofline, labelled, with the command that times bf16
    note = _plan(capsys, monkeypatch, tmp_path, fp32, "--dtype", "bf16")["uncalibrated_estimate"]
    assert "none timed under bf16 autocast" in note and "--precision bf16" in note
    # with them: every op time measured, in either format
    plain = _plan(capsys, monkeypatch, tmp_path, got, "--dtype", "bf16")
    assert plain["uncalibrated_estimate"] is None
    cl = _plan(capsys, monkeypatch, tmp_path, got, "--dtype", "bf16", "--channels-last")
    assert cl["channels_last"] == "measured" and cl["uncalibrated_estimate"] is None
    assert cl["predicted"]["compute_s"] != plain["predicted"]["compute_s"]
