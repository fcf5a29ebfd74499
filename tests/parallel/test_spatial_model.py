"""Spatial layouts (height/width/depth splits with halo exchange) run users' CNNs with one process's
semantics: models written here (a U-Net-like net with strided and transposed convs, nearest upsampling,
max pooling, batch norm and skip concatenation on a 33x47 input; a dilated conv net with residual adds,
a grouped conv, avg and global pooling; a 3-D CNN; TF-style padding read off the conv module and a
mean over the split dims), trained 2 SGD steps in fp64 through `hybridpar.parallelize` in gloo worlds
(one spawn per world size) and through `hybridpar train`, against the same steps in one process.
Layouts the runtime does not serve are refused before start."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.cli.main import main
from hybridpar.errors import UserError
from hybridpar.parallel.check import check
from hybridpar.train.launch import spawn

from ._spatial_model_workers import build, train_cases

TOL = 1e-9  # fp64

WORLDS = {
    2: [("unet", "height=2"), ("unet", "width=2"), ("dilated", "width=2"), ("cnn3d", "depth=2"),
        ("tfpad", "height=2")],
    # spatial x channel/filter in one layer (SpatialDistConv; transposed convs and concat on channel
    # pieces); the 3-D net's corners (depth x height). DTensor's first-step propagation over these 3-4-D
    # meshes took ~100 s for the first two alone before hybridpar.parallel.dtensor.propagation
    4: [("unet", "height=2,width=2"), ("unet", "sample=2,height=2"), ("unet", "height=2,channel=2"),
        ("dilated", "height=2,filter=2"), ("cnn3d", "depth=2,height=2")],
}


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(WORLDS))
def test_spatial_layouts_train_like_one_process(world):
    for (name, strategy), res in zip(WORLDS[world], spawn(train_cases, world, WORLDS[world])):
        for rank, r in enumerate(res["ranks"]):
            assert "error" not in r, f"{res['case']} rank {rank}: {r['error']}"
            for key in ("weights", "out", "loss", "eval"):
                assert r[key] <= TOL, f"{res['case']} rank {rank}: {key} differs by {r[key]} ({r.get('where')})"
            assert r["halo"] > 0, f"{res['case']} rank {rank}: no halo exchanged"
        # the dry run on meta tensors (the planner's record of one step, no p2p there) counts the halo
        # bytes rank 0 sent in a step
        m, x, y = build(name)
        dry = check(m, strategy, x, y, world_size=world, loss_fn=F.cross_entropy)
        assert dry.our_bytes["halo"] == res["ranks"][0]["halo"], res["case"]


def _model_file(tmp_path: Path) -> str:
    root = Path(__file__).resolve().parents[2]
    path = tmp_path / "spatial_net.py"
    path.write_text(f"import sys\nsys.path.insert(0, {str(root)!r})\n"
                    "from tests.parallel._spatial_model_workers import Dilated\n"
                    "def net():\n    return Dilated()\n")
    return f"{path}:net"


def _train(tmp_path, capsys, model: str, strategy: str, nproc: int):
    out = tmp_path / f"{strategy.replace(',', '_').replace('=', '')}.pt"
    code = main(["train", "--model", model, "--input-shape", "3,29,19", "--strategy", strategy, "--nproc",
                 str(nproc), "--batch", "4", "--steps", "2", "--no-shuffle", "--precision", "fp64", "--save",
                 str(out), "--json"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    return torch.load(out, weights_only=True), json.loads(cap.out)


@pytest.mark.slow
def test_train_cli_spatial_equals_one_process(tmp_path, capsys):
    model = _model_file(tmp_path)
    ref, ref_res = _train(tmp_path, capsys, model, "sample=1", 1)
    got, res = _train(tmp_path, capsys, model, "height=2", 2)
    assert set(got) == set(ref)
    err = max(float((got[k].double() - v.double()).abs().max()) for k, v in ref.items() if v.is_floating_point())
    assert err <= TOL, err
    for a, b in zip(res["steps"], ref_res["steps"]):
        assert abs(a["loss"] - b["loss"]) <= TOL
    # the halo exchange's bytes are reported per step like every other kind (rank 0's), the same each step
    halo = [s["comm_bytes"].get("halo", 0) for s in res["steps"]]
    assert halo[0] > 0 and len(set(halo)) == 1, halo
    # and equal to what the dry run (the planner's record of one step) counts on rank 0
    m, x, y = build("dilated")
    assert check(m, "height=2", x, y, world_size=2, inputs="sample_shard").our_bytes["halo"] == halo[0]
    # spatial x channel/filter in one layer through the CLI too
    got, res = _train(tmp_path, capsys, model, "height=2,filter=2", 4)
    err = max(float((got[k].double() - v.double()).abs().max()) for k, v in ref.items() if v.is_floating_point())
    assert err <= TOL, err
    assert all(abs(a["loss"] - b["loss"]) <= TOL for a, b in zip(res["steps"], ref_res["steps"]))
    dry = check(m, "height=2,filter=2", x, y, world_size=4, inputs="sample_shard").our_bytes
    assert res["steps"][-1]["comm_bytes"]["halo"] == dry["halo"] > 0
    assert res["steps"][-1]["comm_bytes"]["allgather"] > 0  # the filter group's gather of the extended piece


def test_spatial_refusals_before_start():
    m, x, y = build("dilated")
    # spatial x channel/filter runs (tests/parallel/test_spatial_compose.py): the dry run passes it
    dry = check(m, "height=2,channel=2", x, y, world_size=4, loss_fn=F.cross_entropy)
    assert dry.our_bytes["halo"] > 0 and dry.our_bytes["reduce_scatter"] > 0
    m.pool = nn.MaxPool2d(2, ceil_mode=True)
    with pytest.raises(UserError, match="module 'pool' .*ceil_mode"):
        check(m, "height=2", x, y, world_size=2)
    m, x, y = build("dilated")
    m.bn = nn.GroupNorm(2, 6)
    with pytest.raises(UserError, match="module 'bn' .*GroupNorm"):
        check(m, "width=2", x, y, world_size=2)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
