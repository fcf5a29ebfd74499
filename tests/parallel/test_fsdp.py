"""Issue 31, first slice: `zero=2|3` (FSDP2 on the sample dimension) and `recompute="all"` train equal to
one process (fp64), through hybridpar.parallelize and `hybridpar train`; the strategy key, what is refused,
and the memory and communication rules."""

from __future__ import annotations

import pytest
import torch
from tests.parallel._fsdp_workers import CASES, SmallNet, make_model, run_cases, train

from hybridpar.errors import UserError
from hybridpar.layout import LayerLayout
from hybridpar.plans import parse_strategy


def _err(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)


# -- vocabulary --------------------------------------------------------------------------------------

def test_zero_is_a_strategy_key_not_a_degree():
    s = parse_strategy("sample=4,zero=3")
    assert (s.layout.sample, s.layout.zero, s.world_size) == (4, 3, 4)
    assert parse_strategy("zero=2", 2).layout == LayerLayout(sample=2, zero=2)
    assert LayerLayout(sample=2, zero=2).to_strategy() == "sample=2,zero=2"
    assert "zero" not in LayerLayout(sample=2).model_dump()  # plans without sharding serialise as before
    lay = LayerLayout(sample=4, zero=3)
    assert LayerLayout.model_validate_json(lay.model_dump_json()) == lay


@pytest.mark.parametrize("text,world,words", [
    ("sample=2,zero=1", 2, "zero must be 2 or 3"),
    ("sample=2,height=2,zero=3", 4, "not with spatial splits"),  # channel/filter compose (test_fsdp_compose)
    ("mp=2,zero=3", 4, "model parallelism"),
])
def test_refused_before_any_rank(text, world, words):
    with pytest.raises(UserError, match=words):
        parse_strategy(text, world)


def test_recompute_refused_with_spatial_splits_and_mp():
    from hybridpar.parallel.fsdp import sharding_refusal

    assert sharding_refusal([LayerLayout(sample=2)], 1, "all") is None
    assert sharding_refusal([LayerLayout(sample=2, channel=2, zero=3)], 1, "all") is None
    assert "spatial splits" in sharding_refusal([LayerLayout(height=2)], 1, "all")
    assert "model parallelism" in sharding_refusal([LayerLayout(sample=2)], 2, "all")
    assert "recompute must be" in sharding_refusal([LayerLayout(sample=2)], 1, "some")


# -- recomputation in one process ----------------------------------------------------------------------

def test_recompute_is_exact_and_updates_batch_norm_once():
    from hybridpar.parallel.fsdp import recompute_blocks

    ref, ours = make_model(), make_model()
    assert recompute_blocks(ours) == ["stem", "body.0", "body.1", "head"]
    calls = [0]
    ours.stem.conv.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    assert train(ref, "sgd") == train(ours, "sgd")
    assert calls[0] == 6  # 3 steps, each forward recomputed once in backward
    assert _err(ours.state_dict(), ref.state_dict()) == 0.0  # running stats included (updated once)
    assert int(ours.stem.bn.num_batches_tracked) == 3


# -- two ranks -------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sharded_and_recomputed_layouts_equal_one_process():
    from hybridpar.train.launch import spawn

    got = spawn(run_cases, 2)
    full = sum(p.numel() for p in SmallNet().parameters())
    for case in CASES:
        strategy, recompute, opt_name, acc = case
        ref = make_model()
        losses = train(ref, opt_name, accumulate=acc)
        r = got[case]
        assert _err(r["state"], ref.state_dict()) <= 1e-9, case  # full_state_dict: unsharded, running stats too
        assert max(abs(a - b) for a, b in zip(losses, r["losses"])) <= 1e-12, case
        sharded = "zero" in strategy
        assert (r["local_numel"] < full * 0.55) == sharded, (case, r["local_numel"], full)
        # forwards of the stem conv: steps (x2 with accumulation) + 3 of the one-time mixed-sample check,
        # + one recomputation per step
        steps = 3 * (2 if acc else 1)
        assert r["conv_calls"] == steps + 3 + (3 if recompute == "all" else 0), case


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_zero3_recompute_equals_one_process(tmp_path, capsys):
    import json

    from hybridpar.cli.main import main

    def run(strategy: str, nproc: int, *extra: str) -> dict:
        out = tmp_path / f"{nproc}.pt"
        code = main(["train", "--model", "tests/parallel/_fsdp_workers.py:small_net", "--input-shape", "3,6,6",
                     "--strategy", strategy, "--nproc", str(nproc), "--batch", "8", "--steps", "3", "--no-shuffle",
                     "--precision", "fp64", "--momentum", "0.9", "--save", str(out), "--json", *extra])
        cap = capsys.readouterr()
        assert code == 0, cap.err
        json.loads(cap.out)
        return torch.load(out, weights_only=True)

    got = run("sample=2,zero=3", 2, "--recompute", "all")
    want = run("sample=1", 1)
    assert _err(got, want) <= 1e-9


def test_cli_refuses_zero_with_spatial_in_one_line(capsys):
    from hybridpar.cli.main import main

    code = main(["train", "--model", "tests/parallel/_fsdp_workers.py:small_net", "--input-shape", "3,6,6",
                 "--strategy", "sample=1,height=2,zero=3", "--nproc", "2", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "not with spatial splits" in err and "Traceback" not in err


# -- cost rules -----------------------------------------------------------------------------------------

def _graph():
    from hybridpar.graph import trace

    return trace(SmallNet(), (torch.randn(8, 3, 6, 6),))


def test_memory_rule_shards_state_by_the_sample_degree():
    from hybridpar.cost.memory import predict_rank_memory

    g = _graph()
    params = sum(p.numel() for p in SmallNet().parameters()) * 4
    blocks = {"stem": (6 * 3 * 9 + 6) + 12, "body.0": (6 * 6 * 9 + 6) + 12, "body.1": (4 * 6 * 9 + 4) + 8,
              "head": 25}
    largest = max(blocks.values()) * 4
    for s in (2, 4):
        ddp = predict_rank_memory(g, f"sample={s}", optimizer="adamw", framework_bytes=0)
        z3 = predict_rank_memory(g, f"sample={s},zero=3", optimizer="adamw", framework_bytes=0)
        z2 = predict_rank_memory(g, f"sample={s},zero=2", optimizer="adamw", framework_bytes=0)
        assert ddp.weights_bytes == params and ddp.optimizer_bytes == 2 * params
        assert z3.grads_bytes == pytest.approx(params / s) and z3.optimizer_bytes == pytest.approx(2 * params / s)
        assert z3.weights_bytes == pytest.approx(params / s + largest)  # one block gathered in flight
        assert z2.weights_bytes == pytest.approx(params / s + params)  # every block kept gathered till backward
        assert z3.buckets_bytes == pytest.approx(largest)  # one block's whole gradient before its reduce-scatter
        assert z3.activations_bytes == ddp.activations_bytes
    plain = predict_rank_memory(g, "sample=2", framework_bytes=0)
    rc = predict_rank_memory(g, "sample=2", framework_bytes=0, recompute="all")
    assert rc.activations_bytes < plain.activations_bytes and rc.weights_bytes == plain.weights_bytes


def test_fsdp_collectives_per_block():
    from hybridpar.cost.layout_comm import fsdp_collectives

    g = _graph()
    ops = fsdp_collectives(g, LayerLayout(sample=2, zero=3), dtype_bytes=8)
    head = [op for b, op in ops if b == "head"]
    # Linear(4, 5): weight 5x4 and bias 5, dim 0 padded to 6 over 2 ranks
    assert [(op.kind, op.phase, op.bytes_) for op in head] == [
        ("allgather", "fwd", 240), ("allgather", "bwd", 240), ("reduce_scatter", "grad", 240)]
    z2 = fsdp_collectives(g, LayerLayout(sample=2, zero=2), dtype_bytes=8)
    assert len(z2) == 2 * len({b for b, _ in ops}) and not any(op.phase == "bwd" for _, op in z2)
    assert fsdp_collectives(g, LayerLayout(sample=2)) == []


