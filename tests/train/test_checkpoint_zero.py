"""Issue 31: checkpoints of FSDP-sharded state (`zero=2|3`): each rank writes only its FSDP shard (with its
place in the undistributed tensor, hybridpar.train.checkpoint_sharded) as chunks of a
torch.distributed.checkpoint directory (hybridpar.train.checkpoint_dcp), and a run resumed under another
layout equals an uninterrupted one."""

from __future__ import annotations

import pytest
import torch

from hybridpar.cli.main import main
from hybridpar.train import checkpoint as ckpt

BASE = ["train", "--model", "tests/parallel/_fsdp_workers.py:small_net", "--input-shape", "3,6,6", "--batch", "8",
        "--no-shuffle", "--precision", "fp64", "--momentum", "0.9", "--json"]


def _run(capsys, *argv: str) -> None:
    code = main([*BASE, *argv])
    cap = capsys.readouterr()
    assert code == 0, cap.err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero3_checkpoint_resumes_under_another_layout(tmp_path, capsys):
    ck = tmp_path / "ck"
    _run(capsys, "--strategy", "sample=1", "--nproc", "1", "--steps", "4", "--save", str(tmp_path / "want.pt"))
    _run(capsys, "--strategy", "sample=2,zero=3", "--nproc", "2", "--steps", "2", "--checkpoint-dir", str(ck),
         "--checkpoint-every", "2")
    info = ckpt.latest_checkpoint(ck)  # manifest and every file's SHA-256 check out
    assert info is not None and info.step == 2 and info.world_size == 2
    from hybridpar.train.checkpoint_dcp import read_metadata

    md = read_metadata(info.path, info.manifest).state_dict_metadata  # a DCP checkpoint: chunks of full tensors
    w = "stem.conv.weight"
    for key in (f"model.{w}", f"optim.state.{w}.momentum_buffer"):  # each rank its FSDP shard's rows
        assert tuple(md[key].size) == (6, 3, 3, 3)
        assert sorted((c.offsets[0], c.sizes[0]) for c in md[key].chunks) == [(0, 3), (3, 3)]
    full = ckpt.full_model_state(info)
    assert tuple(full[w].shape) == (6, 3, 3, 3)
    _run(capsys, "--strategy", "sample=2", "--nproc", "2", "--steps", "4", "--checkpoint-dir", str(ck), "--resume",
         "--save", str(tmp_path / "got.pt"))
    want, got = torch.load(tmp_path / "want.pt", weights_only=True), torch.load(tmp_path / "got.pt", weights_only=True)
    assert want.keys() == got.keys()
    assert max((want[k].double() - got[k].double()).abs().max().item() for k in want) <= 1e-9


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_channel_zero3_checkpoint_resumes_on_one_rank(tmp_path, capsys):
    """FSDP shards of channel pieces (their rows of a piece, composed with the piece's place)."""
    ck = tmp_path / "ck"
    _run(capsys, "--strategy", "sample=1", "--nproc", "1", "--steps", "4", "--save", str(tmp_path / "want.pt"))
    _run(capsys, "--strategy", "sample=2,channel=2,zero=3", "--nproc", "4", "--steps", "2", "--checkpoint-dir",
         str(ck), "--checkpoint-every", "2")
    info = ckpt.latest_checkpoint(ck)
    assert info is not None and info.world_size == 4
    full = ckpt.full_model_state(info)  # the pieces cover every tensor
    assert tuple(full["stem.conv.weight"].shape) == (6, 3, 3, 3)
    _run(capsys, "--strategy", "sample=1", "--nproc", "1", "--steps", "4", "--checkpoint-dir", str(ck), "--resume",
         "--save", str(tmp_path / "got.pt"))
    want, got = torch.load(tmp_path / "want.pt", weights_only=True), torch.load(tmp_path / "got.pt", weights_only=True)
    assert max((want[k].double() - got[k].double()).abs().max().item() for k in want) <= 1e-9
