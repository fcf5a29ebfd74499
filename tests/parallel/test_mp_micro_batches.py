"""GPipe micro-batches in the user's own loop (hybridpar.parallelize(model, plan, micro_batches=K),
pipeline.module): models not in the zoo with tuple and dict outputs train with AdamW and a custom loss
equal to one fp64 process, K forwards' messages cross per step (the batch really is cut), uneven
micro-batches included; batch norm is refused under K > 1 unless bn_stats="local" says so."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hybridpar.train.launch import spawn

from . import _mp_own_loop_workers as w


def _run(cases) -> list[dict]:
    import hybridpar
    from hybridpar.plans import Plan

    out = []
    for name, k in cases:
        model = w.build(name, torch.float64)
        spec = Plan(model=name, world_size=2, batch=w.BATCH, dp=1, mp=2, placement=w.MODELS[name][2],
                    default_layout={"sample": 1})
        model = hybridpar.parallelize(model, spec, micro_batches=k)
        log = model.hybridpar.comm_log
        log.mark_step()
        losses = w.train(model, name, torch.float64)
        sends = sum(1 for r in log.records if r.kind == "send")  # every step's, this rank's
        out.append({"state": hybridpar.full_state_dict(model), "losses": losses, "sends": sends})
    return out


def run_cases(cases) -> list[dict]:
    res = _run(cases)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [r["sends"] for r in res])
    for r, k in zip(res, zip(*every)):
        r["sends"] = sum(k)
    return res


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpipe_micro_batches_equal_one_process():
    # 8 samples: K=2 (4+4), K=3 (3+3+2: uneven); the dict-output LSTM LM and the tuple-output two-input net
    cases = [("lstm_dict", 1), ("lstm_dict", 3), ("two_input", 2)]
    out = spawn(run_cases, 2, cases)
    for (name, k), res in zip(cases, out):
        ref, ref_losses = w.serial(name, torch.float64)
        for key, v in ref.items():
            torch.testing.assert_close(res["state"][key], v, rtol=1e-9, atol=1e-10, msg=f"{name} K={k}: {key}")
        assert res["losses"] == pytest.approx(ref_losses, rel=1e-9), f"{name} K={k}"
    one, three = out[0]["sends"], out[1]["sends"]
    assert one > 0 and three == 3 * one  # each micro-batch's activations cross on their own


def test_batch_norm_refused_under_micro_batches_unless_local():
    from hybridpar.errors import UserError
    from hybridpar.parallel.pipeline.module import check_micro_batches

    from .mp_user_models import BN1dNet

    with pytest.raises(UserError, match="normalise each micro-batch separately") as err:
        check_micro_batches(BN1dNet(), 2, "global")
    assert "\n" not in str(err.value)
    check_micro_batches(BN1dNet(), 2, "local")  # per-micro-batch statistics, asked for
    check_micro_batches(BN1dNet(), 1, "global")


def test_train_refuses_batch_norm_micro_batches_before_start(capsys):
    from hybridpar.cli.main import main

    assert main(["train", "--model", "small_cnn", "--strategy", "mp=2", "--nproc", "2", "--batch", "8",
                 "--micro-batches", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "micro-batch" in err and "--bn-stats local" in err and "\n" not in err
