"""Issue 31: FSDP2 on the `sample` dimension of the plan's DeviceMesh composed with our channel/filter
layers on the others (`sample=2,channel=2,zero=3|2`), recomputation with channel/filter layers, and
no_sync with FSDP blocks: equal to one process (fp64), 4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tests.parallel._fsdp_workers import SmallNet, make_model, train
from torch import nn

import hybridpar

# (strategy, recompute, optimizer, accumulate under no_sync, model)
CASES = [("sample=2,channel=2,zero=3", "none", "adamw", False, "small"),
         ("sample=2,channel=2,zero=2", "none", "sgd", False, "small"),
         ("sample=2,channel=2", "all", "sgd", False, "small"),
         ("sample=2,filter=2,zero=3", "all", "adamw", True, "gain")]


class GainNet(SmallNet):
    """A parameter of the model's own between our layers (a replicated DTensor under channel/filter
    layouts, which FSDP cannot hold on `sample`: GradSync keeps it)."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        x = self.stem(x)
        for b in self.body:
            x = b(x)
        return self.head((x * self.gain.view(1, -1, 1, 1)).mean((2, 3)))


def _model(name: str) -> nn.Module:
    if name == "small":
        return make_model()
    torch.manual_seed(0)
    return GainNet().double()


def _err(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)


def run_cases(cases=CASES) -> dict:
    """Every case on this world: rank 0's full_state_dict, losses, local parameter sizes, stem conv calls,
    and how many parameters FSDP holds (DTensors sharded on the sample dim)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for case in cases:
        strategy, recompute, opt_name, acc, name = case
        model = _model(name)
        hybridpar.parallelize(model, strategy, recompute=recompute)
        calls = [0]  # on our layer (the model's conv is swapped for it): recomputation calls it again
        model.stem.conv.register_forward_hook(lambda *_, c=calls: c.__setitem__(0, c[0] + 1))
        losses = train(model, opt_name, steps=2, accumulate=acc)
        full = hybridpar.full_state_dict(model)
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
        fsdp = sum(isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("sample",) for p in model.parameters())
        out[case] = {"state": full, "losses": losses, "local_numel": local, "conv_calls": calls[0],
                     "fsdp_params": fsdp, "params": len(list(model.parameters())), "rank": dist.get_rank()}
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_composed_with_channel_filter_equals_one_process():
    from hybridpar.train.launch import spawn

    got = spawn(run_cases, 4)
    plain = got[CASES[2]]["local_numel"]
    for case in CASES:
        strategy, recompute, opt_name, acc, name = case
        ref = _model(name)
        losses = train(ref, opt_name, steps=2, accumulate=acc)
        r = got[case]
        assert _err(r["state"], ref.state_dict()) <= 1e-9, case
        assert max(abs(a - b) for a, b in zip(losses, r["losses"])) <= 1e-12, case
        sharded = "zero" in strategy
        assert (r["fsdp_params"] > 0) == sharded, case
        if sharded:  # every parameter but GainNet's gain (a replicated DTensor, synchronised by GradSync)
            assert r["fsdp_params"] == r["params"] - (name == "gain"), case
        if sharded and "channel" in strategy:
            assert r["local_numel"] < plain * 0.6, (case, r["local_numel"], plain)
        steps = 2 * (2 if acc else 1)
        assert r["conv_calls"] == steps * (2 if recompute == "all" else 1), (case, r["conv_calls"])


def _cli(tmp_path, capsys, strategy: str, nproc: int, *extra: str) -> dict:
    import json

    import torch

    from hybridpar.cli.main import main

    out = tmp_path / f"{nproc}-{len(extra)}.pt"
    code = main(["train", "--model", "tests/parallel/_fsdp_workers.py:small_net", "--input-shape", "3,6,6",
                 "--strategy", strategy, "--nproc", str(nproc), "--batch", "8", "--steps", "2", "--no-shuffle",
                 "--momentum", "0.9", "--save", str(out), "--json", *extra])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    json.loads(cap.out)
    return torch.load(out, weights_only=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_channel_zero3_recompute_equals_one_process(tmp_path, capsys):
    got = _cli(tmp_path, capsys, "sample=2,channel=2,zero=3", 4, "--recompute", "all", "--precision", "fp64")
    want = _cli(tmp_path, capsys, "sample=1", 1, "--precision", "fp64")
    assert _err(got, want) <= 1e-9
