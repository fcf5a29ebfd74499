"""Issue 31: FSDP2's collectives in the comm log (bytes sent = hybridpar.cost.layout_comm.fsdp_collectives),
no_sync deferring them (gradient accumulation), and FSDP2's bf16 MixedPrecisionPolicy; 2 ranks."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from tests.parallel._fsdp_workers import SmallNet, data, make_model, make_opt, train

import hybridpar


def _fsdp_records(log) -> list[tuple[str, str, str, int]]:
    """(block, kind, phase, bytes) of the FSDP collectives since the log's last mark_step."""
    out = []
    for r in log.step_records():
        if r.tag.startswith("fsdp:"):
            _, block, phase = r.tag.split(":")
            out.append((block, r.kind, phase, r.bytes_))
    return out


def run_comm() -> dict:
    out: dict = {}
    for strategy in ("sample=2,zero=3", "sample=2,zero=2"):
        model = hybridpar.parallelize(make_model(), strategy)
        log = model.hybridpar.grid.comm_log
        train(model, "sgd", steps=1)  # FSDP's lazy init on the first step
        log.mark_step()
        train(model, "sgd", steps=1)
        out[strategy] = _fsdp_records(log)
        log.mark_step()
        train(model, "sgd", steps=1, accumulate=True)  # two half-batches, the first under no_sync
        out[strategy, "accumulate"] = _fsdp_records(log)
    torch.manual_seed(0)
    model = hybridpar.parallelize(SmallNet(), "sample=2,zero=3", mixed_precision="bf16")
    log = model.hybridpar.grid.comm_log
    out["bf16_losses"] = _train_fp32(model, log.mark_step)  # the last step's records (not the first's checks)
    out["bf16_state"] = hybridpar.full_state_dict(model)
    out["bf16"] = _fsdp_records(log)
    return out


def _train_fp32(model, mark=lambda: None, steps: int = 3) -> list[float]:
    opt = make_opt("sgd", model.parameters())  # (AdamW's sign-like updates would hide how close the gradients are)
    losses = []
    for x, y in data(steps):
        mark()
        opt.zero_grad()
        loss = F.cross_entropy(model(x.float()), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fsdp_bytes_no_sync_and_bf16():
    from hybridpar.cost.layout_comm import fsdp_collectives
    from hybridpar.graph import trace
    from hybridpar.layout import LayerLayout
    from hybridpar.train.launch import spawn

    got = spawn(run_comm, 2)
    g = trace(SmallNet(), (torch.randn(8, 3, 6, 6),))
    for zero in (3, 2):
        strategy = f"sample=2,zero={zero}"
        want = [(b, op.kind, op.phase, op.bytes_) for b, op in fsdp_collectives(g, LayerLayout(sample=2, zero=zero),
                                                                                dtype_bytes=8)]
        assert Counter(got[strategy]) == Counter(want), (strategy, got[strategy], want)  # bytes sent = predicted
        # no_sync: the first half-batch's backward reduce-scatters nothing (one reduce-scatter per block)
        acc = got[strategy, "accumulate"]
        assert Counter(k for _, k, _, _ in acc)["reduce_scatter"] == Counter(k for _, k, _, _ in want)["reduce_scatter"]
    # bf16: parameters gathered in bf16 (2 bytes), gradients reduce-scattered in fp32 (4 bytes)
    # (batch norms keep fp32 weights: their own units)
    want32 = fsdp_collectives(g, LayerLayout(sample=2, zero=3), dtype_bytes=4)
    padded = {n: -(-p.shape[0] // 2) * 2 * p[0].numel() for n, p in SmallNet().named_parameters()}
    gathered = sum(k * (4 if ".bn." in n else 2) for n, k in padded.items())
    assert sum(b for _, k, _, b in got["bf16"] if k == "allgather") == 2 * gathered  # forward and backward
    assert sum(b for _, k, _, b in got["bf16"] if k == "reduce_scatter") == \
        sum(op.bytes_ for _, op in want32 if op.kind == "reduce_scatter")
    torch.manual_seed(0)
    ref = SmallNet()
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_losses = _train_fp32(ref)
    assert max(abs(a - b) for a, b in zip(ref_losses, got["bf16_losses"])) < 2e-2
    assert all(got["bf16_state"][k].dtype == v.dtype for k, v in ref.state_dict().items())  # fp32 master weights
    err = max((got["bf16_state"][k].float() - v.float()).abs().max().item() for k, v in ref.state_dict().items())
    moved = max((v.float() - init[k].float()).abs().max().item() for k, v in ref.state_dict().items())
    assert 0 < err < 0.05 * moved, (err, moved)  # bf16 compute: within a few bf16 ulps of the fp32 run, not equal


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_bf16_zero3_tracks_one_process(tmp_path, capsys):
    from tests.parallel.test_fsdp_compose import _cli

    got = _cli(tmp_path, capsys, "sample=2,zero=3", 2, "--precision", "bf16")
    want = _cli(tmp_path, capsys, "sample=1", 1, "--precision", "bf16", "--lr", "0.1")
    init = _cli(tmp_path, capsys, "sample=1", 1, "--precision", "bf16", "--lr", "1e-30")  # ~untrained
    assert all(got[k].dtype == want[k].dtype for k in want)  # fp32 master weights
    err = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
    moved = max((want[k].float() - init[k].float()).abs().max().item() for k in want)
    assert err < 0.05 * moved, (err, moved)
