"""What a placement says about itself (review of the placer): an UNCALIBRATED label when its op times on
this CPU are the roofline's (issue 35, as `plan` has it), no pipelining chosen on a guess on an unprofiled
CPU whatever the schedule, a note when no micro-batch count fits the memory, and the user's micro-batch
count priced as the run uses it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from hybridpar.cli.main import main
from hybridpar.cluster.calibration import Calibration, Measurement, OpRecord, save_calibration
from hybridpar.cost.compute import FREE_OPS, local_shapes
from hybridpar.cost.coverage import LABEL
from hybridpar.errors import UserError
from hybridpar.search.placer import micro
from hybridpar.search.placer.api import model_graph, place_model

ARGS = ["place", "--model", "lstm2", "--gpus", "2", "--solver", "greedy", "--batch", "8", "--time-chunks", "1"]
_M = Measurement(median_s=1e-5, p10_s=1e-5, p90_s=1e-5, repeats=3)


@pytest.mark.timeout(90)
def test_place_on_a_cpu_is_labelled_until_its_ops_are_measured(tmp_path, monkeypatch, capsys):
    path = tmp_path / "cal.json"
    monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(path))
    capsys.readouterr()
    assert main(ARGS) == 0
    out = capsys.readouterr().out
    assert "UNCALIBRATED ESTIMATE" in out.split("note:")[0]  # the table's title
    assert f"note: {LABEL}: no calibration file" in out and "hybridpar profile --model lstm2 --batch 8" in out
    assert main([*ARGS, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["uncalibrated_estimate"].startswith(LABEL) and got["notes"][0] == got["uncalibrated_estimate"]
    # every op of the graph measured at the batch (one micro-batch: the unprofiled CPU's count): no label
    fine, _ = model_graph("lstm2", 8)
    keys = {local_shapes(n).key(n.op): n.op for n in fine.nodes if n.op not in FREE_OPS}
    ops = {k: OpRecord(key=k, op=op, fwd=_M, bwd_data=_M, bwd_weight=_M) for k, op in keys.items()}
    save_calibration(Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10, ops=ops), path)
    assert main([*ARGS, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["uncalibrated_estimate"] is None and not any(n.startswith(LABEL) for n in got["notes"])
    assert got["micro_batches"] == 1


@pytest.mark.timeout(90)
def test_an_unprofiled_cpu_chooses_no_pipelining_whatever_the_schedule():
    for schedule, k in ((None, 1), ("gpipe", 1), ("1f1b", 2)):  # 1f1b: its fewest, one per stage
        plan = place_model("lstm2", "localhost", 2, solver="greedy", batch=8, time_chunks=1, schedule=schedule).plan
        assert (plan.micro_batches, plan.schedule) == (k, schedule or "gpipe"), plan.notes
        assert any("not measured on this CPU" in n for n in plan.notes)
    # a count asked for is priced as asked
    plan = place_model("lstm2", "localhost", 2, solver="greedy", batch=8, time_chunks=1, schedule="gpipe",
                       micro_batches=4).plan
    assert plan.micro_batches == 4 and "micro-batches: 4 (as asked)" in plan.notes


@pytest.mark.timeout(90)
def test_no_count_that_fits_is_said(monkeypatch):
    real = micro.pipeline_memory
    monkeypatch.setattr(micro, "pipeline_memory", lambda *a, **kw: [m + 2**40 for m in real(*a, **kw)])
    plan = place_model("lstm2", "localhost", 2, solver="greedy", batch=8, time_chunks=1, micro_batches=2).plan
    assert any(n.startswith("over the memory limit: device") for n in plan.notes), plan.notes


def test_the_users_micro_batches_are_placed_for_without_a_schedule(monkeypatch):
    """hybridpar.parallelize(..., example_inputs=, micro_batches=K): rank 0's placement is priced with K."""
    import torch.distributed as dist

    import hybridpar
    from hybridpar import api

    asked = {}

    def fake_place(module, cluster, gpus, **kw):
        asked.update(kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr(api, "place", fake_place)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 0)
    monkeypatch.setattr(dist, "broadcast_object_list", lambda *a, **kw: None)
    place = hybridpar._placer((torch.zeros(8, 3),), "localhost", None, None, 4)
    with pytest.raises(UserError, match="stop here"):
        place(SimpleNamespace(dp=1, mp=2), torch.nn.Linear(3, 3))
    assert asked["micro_batches"] == 4 and asked.get("schedule") is None


def test_one_free_op_set_and_one_time_chunk_default(capsys):
    from hybridpar.cost import compute, coverage
    from hybridpar.profile import graph_ops
    from hybridpar.search.placer import unroll

    assert graph_ops._SKIP is compute.FREE_OPS and not hasattr(coverage, "_FREE")
    assert not hasattr(unroll, "CHOSEN_TIME_CHUNKS")
    assert main(["place", "--help"]) == 0
    assert f"whole or {unroll.WHAT_IF_TIME_CHUNKS} chunks" in " ".join(capsys.readouterr().out.split())
