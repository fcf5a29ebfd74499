"""Model parallelism and hybrid DP x MP in the user's own loop (hybridpar.parallelize with mp > 1, issue
32): models not in the zoo (a branchy CNN, a two-input model with a tuple output, a stacked-LSTM language
model with a dict output, BatchNorm1d and BatchNorm3d nets) trained with AdamW and a custom loss equal one
process; the outputs are whole on every rank (eval mode too); batch norm of every kind has global-batch
statistics under mp x sample, and what the runtime cannot make global is refused before any step.

One spawned world per size runs every case of that size (spawning costs more than a case)."""

from __future__ import annotations

import pytest
import torch

from hybridpar.train.launch import spawn

from . import _mp_own_loop_workers as w

MODELS = ["branchy", "two_input", "lstm_dict", "bn1d", "bn3d"]


def _check(cases, results, tol_fp64=1e-9, tol_fp32=1e-4):
    for (name, dp, dtype_name, how), res in zip(cases, results):
        dtype = getattr(torch, dtype_name)
        ref, ref_losses = w.serial(name, dtype)
        label = f"{name} dp={dp} {dtype_name} {how}"
        tol = tol_fp64 if dtype == torch.float64 else tol_fp32
        assert res["state"].keys() == ref.keys(), label
        for k, v in ref.items():
            if v.is_floating_point():
                err = float((res["state"][k] - v).abs().max())
                assert err <= tol, f"{label}: {k} differs by {err:.2e}"
            else:
                assert torch.equal(res["state"][k], v), f"{label}: {k}"
        assert res["losses"] == pytest.approx(ref_losses, rel=tol, abs=tol), label
        assert res["eval_same"], f"{label}: ranks got different outputs"
        assert torch.allclose(res["eval"], w.serial_eval(name, dtype), rtol=tol, atol=tol), f"{label}: eval outputs"
        if how != "placer":  # the test placements cross devices; rank 0 holds a share only
            assert res["sent"] > 0, f"{label}: no activation crossed devices"
            total = sum(p.numel() for p in w.build(name, dtype).parameters())
            assert 0 < res["held"] < total, label


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_own_loop_mp2_equals_one_process():
    cases = [(name, 1, "float64", "plan" if i % 2 == 0 else "strategy") for i, name in enumerate(MODELS)]
    cases.append(("two_input", 1, "float64", "placer"))
    out = spawn(w.run_all, 2, cases, False)
    _check(cases, out["cases"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_own_loop_mp2_sample2_equals_one_process_and_batch_norm_is_global():
    # BatchNorm1d ([N, C] and [N, C, L]), BatchNorm3d and a user's BatchNorm3d subclass: global-batch
    # statistics (per-replica ones were 6.6e-2 / 1.5e-2 off one process after 4 fp64 steps)
    cases = [(name, 2, "float64", "plan" if i % 2 == 0 else "strategy") for i, name in enumerate(MODELS)]
    # fp32 on a model without a bias feeding a batch norm (its gradient is ~0: AdamW steps on rounding noise)
    cases.append(("two_input", 2, "float32", "plan"))
    out = spawn(w.run_all, 4, cases, True)
    _check(cases, out["cases"])
    assert "F.batch_norm" in out["refused"] and "batch_norm" in out["refused"], out["refused"]


def test_batch_norm_subclass_is_one_module_in_the_runtime_graph():
    """A user's subclass of BatchNorm3d is a leaf of the runtime's trace, so the global-statistics swap
    reaches it (torch.fx alone traces into it: F.batch_norm with per-replica statistics)."""
    from hybridpar.parallel.pipeline.norm import unreachable_batch_norms
    from hybridpar.parallel.pipeline.partition import partition_module

    from .mp_user_models import BN3dNet

    part = partition_module(BN3dNet(), {"bn2": 1}, 2)
    targets = {str(n.target) for n in part.nodes if n.op == "call_module"}
    assert {"bn1", "bn2"} <= targets
    assert unreachable_batch_norms(part.gm) == []
    assert part.device_of["bn2"] == 1


def test_mp_strategy_without_placement_is_refused_in_one_line():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hybridpar.errors import UserError
    from hybridpar.parallel.api import parallelize

    from .mp_user_models import BranchyCNN

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        with pytest.raises(UserError, match="needs the placement") as err:
            parallelize(BranchyCNN(), "mp=2")
        assert "\n" not in str(err.value)
        with pytest.raises(UserError, match="sample"):
            parallelize(BranchyCNN(), "mp=2,filter=2", placement={"head": 1})
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_cli_two_input_model_and_input_shape_under_mp(tmp_path, capsys):
    """`hybridpar train --strategy mp=2` of a two-input model (a TypeError from tensor_split before) equals
    one process; a file model given --input-shape is placed at that shape (it asked for the flag before)."""
    from pathlib import Path

    from hybridpar.cli.main import main

    from .fp64_runs import train_fp64

    models = Path(__file__).with_name("mp_user_models.py")
    one, loss1, _ = train_fp64(tmp_path, capsys, f"{models}:two_input", "sample=1", "1")
    got, loss2, _ = train_fp64(tmp_path, capsys, f"{models}:two_input", "mp=2", "2")
    assert loss2 == pytest.approx(loss1, rel=1e-9)
    for k in one:
        torch.testing.assert_close(got[k], one[k], rtol=1e-9, atol=1e-9)
    code = main(["train", "--model", f"{models}:branchy", "--input-shape", "3,8,8", "--strategy", "mp=2",
                 "--nproc", "2", "--batch", "8", "--steps", "2", "--json"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
