"""Issue 31 item 5: checkpoints of sharded state through torch.distributed.checkpoint (DCP). Each rank writes
its channel/filter piece's FSDP shard (and its optimizer slots) as chunks of the full tensors; a resume under
another layout or rank count is DCP's own resharding; the step directory is one that torch's `dcp.load`
reads into a plain model; its `.metadata` (a pickle) is checked and read through an allow-list, never
unpickled as it comes (hybridpar.train.checkpoint_dcp)."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil

import pytest
import torch

from hybridpar.cli.main import main
from hybridpar.errors import UserError
from hybridpar.parallel.state import ShardInfo, place, take
from hybridpar.train import checkpoint as ckpt
from hybridpar.train import checkpoint_dcp as cd

NET = "tests/parallel/_fsdp_workers.py:small_net"
BASE = ["train", "--model", NET, "--input-shape", "3,6,6", "--batch", "8", "--no-shuffle", "--precision", "fp64",
        "--optimizer", "adamw", "--lr", "0.01", "--json"]
W = "stem.conv.weight"


def _run(capsys, *argv: str) -> None:
    code = main([*BASE, *argv])
    cap = capsys.readouterr()
    assert code == 0, cap.err


def _max_diff(a: str, b: str) -> float:
    want, got = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert want.keys() == got.keys()
    return max((want[k].double() - got[k].double()).abs().max().item() for k in want)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Four AdamW steps on one rank (the answer), and two under sample=2,channel=2,zero=3 on 4 ranks,
    checkpointed: AdamW's moments of FSDP shards of channel pieces, and its step counts."""
    d = tmp_path_factory.mktemp("dcp")
    for argv in (["--strategy", "sample=1", "--nproc", "1", "--steps", "4", "--save", str(d / "want.pt")],
                 ["--strategy", "sample=2,channel=2,zero=3", "--nproc", "4", "--steps", "2",
                  "--checkpoint-dir", str(d / "ck"), "--checkpoint-every", "2"]):
        assert main([*BASE, *argv]) == 0
    return d


@pytest.fixture
def ck(saved, tmp_path):
    shutil.copytree(saved / "ck", tmp_path / "ck")
    return tmp_path / "ck"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_saved_under_channel_zero3_resumes_under_sample_zero2(saved, ck, tmp_path, capsys):
    info = ckpt.latest_checkpoint(ck)
    assert info is not None and info.step == 2 and info.world_size == 4
    assert info.manifest["version"] == ckpt.VERSION_DCP and (info.path / cd.METADATA).is_file()
    _run(capsys, "--strategy", "sample=2,zero=2", "--nproc", "2", "--steps", "4", "--checkpoint-dir", str(ck),
         "--resume", "--save", str(tmp_path / "got.pt"))
    assert _max_diff(saved / "want.pt", tmp_path / "got.pt") <= 1e-9


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_saved_under_channel_zero3_resumes_on_one_rank(saved, ck, tmp_path, capsys):
    assert ckpt.latest_checkpoint(ck).manifest["storage"] == cd.STORAGE
    _run(capsys, "--strategy", "sample=1", "--nproc", "1", "--steps", "4", "--checkpoint-dir", str(ck), "--resume",
         "--save", str(tmp_path / "got.pt"))
    assert _max_diff(saved / "want.pt", tmp_path / "got.pt") <= 1e-9
    info = ckpt.latest_checkpoint(ck)  # a whole-tensor layout writes rank files (version 1)
    assert info.step == 4 and info.manifest["version"] == ckpt.VERSION


@pytest.mark.slow
def test_the_step_directory_is_read_by_torchs_own_dcp_load(saved):
    """A user reads a checkpoint with torch alone: `dcp.load({"model": sd}, checkpoint_id=step dir)`."""
    import torch.distributed.checkpoint as dcp
    from tests.parallel._fsdp_workers import small_net

    info = ckpt.latest_checkpoint(saved / "ck")
    model = small_net().double()
    sd = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({"model": sd}, checkpoint_id=info.path)
    mine = ckpt.full_model_state(info)
    assert sd.keys() == mine.keys() and all(torch.equal(sd[k], mine[k]) for k in sd)
    model.load_state_dict(sd)
    md = cd.read_metadata(info.path, info.manifest).state_dict_metadata
    assert {f"optim.state.{W}.{s}" for s in ("exp_avg", "exp_avg_sq", "step")} <= md.keys()
    # rank (s, c) wrote FSDP rows s of channel piece c: 4 chunks, distinct, tiling the weight
    assert len(md[f"model.{W}"].chunks) == 4


def _rewrite_metadata(step_dir, data: bytes) -> None:
    """Replace `.metadata` and make the manifest agree with it, checksums and all (what a forger does)."""
    (step_dir / cd.METADATA).write_bytes(data)
    m = json.loads((step_dir / "manifest.json").read_text())
    for f in m["files"]:
        if f["file"] == cd.METADATA:
            f["bytes"], f["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    m["manifest_sha256"] = ckpt.manifest_digest(m)
    (step_dir / "manifest.json").write_text(json.dumps(m))


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (shutil.copyfile, (__file__, self.marker))  # what an unpickled file could do: anything


@pytest.mark.slow
def test_a_forged_metadata_pickle_is_refused_not_run(saved, ck, tmp_path):
    step_dir = ckpt.latest_checkpoint(ck).path
    marker = tmp_path / "ran"
    _rewrite_metadata(step_dir, pickle.dumps(_Payload(str(marker))))
    info = ckpt.checkpoint_info(step_dir, verify_hashes=True)  # the manifest checks out
    with pytest.raises(UserError, match="is not DCP metadata"):
        ckpt.full_model_state(info)
    assert not marker.exists()


@pytest.mark.slow
def test_metadata_naming_a_file_outside_the_manifest_is_refused(saved, ck):
    step_dir = ckpt.latest_checkpoint(ck).path
    md = cd.read_metadata(step_dir, ckpt.read_manifest(step_dir))
    first = next(iter(md.storage_data))
    md.storage_data[first].relative_path = "../../want.pt"
    _rewrite_metadata(step_dir, pickle.dumps(md))
    with pytest.raises(UserError, match="names a data file the manifest does not list"):
        ckpt.full_model_state(ckpt.checkpoint_info(step_dir, verify_hashes=True))
    (step_dir / cd.METADATA).write_bytes(b"x" + (step_dir / cd.METADATA).read_bytes()[1:])  # one byte, no re-sign
    with pytest.raises(UserError, match="SHA-256"):
        ckpt.read_manifest(step_dir)
    m = json.loads((step_dir / "manifest.json").read_text())  # a manifest entry outside the directory
    m["files"][-1]["file"] = "../../want.pt"
    m["manifest_sha256"] = ckpt.manifest_digest(m)
    (step_dir / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="is not a DCP file of this directory"):
        ckpt.read_manifest(step_dir, verify_hashes=False)


def test_boxes_of_a_strided_uneven_piece_tile_it():
    """A stationary-w-like piece: rows {0,1,4} x columns {1..3, 6}: 2 x 2 boxes of the full tensor."""
    full = torch.arange(7 * 8, dtype=torch.float64).reshape(7, 8)
    info = ShardInfo((7, 8), (((0, 2), (4, 1)), ((1, 3), (6, 1))))
    local = take(full, info).clone()
    bs = cd.boxes(local, info)
    assert [(b.offsets, b.sizes) for b in bs] == [((0, 1), (2, 3)), ((0, 6), (2, 1)), ((4, 1), (1, 3)),
                                                  ((4, 6), (1, 1))]
    got, want = torch.zeros(7, 8, dtype=torch.float64), torch.zeros(7, 8, dtype=torch.float64)
    for b in bs:  # each box's view of the piece is that box of the full tensor
        (r, c), (nr, nc) = b.offsets, b.sizes
        assert torch.equal(b.view, full[r:r + nr, c:c + nc])
        got[r:r + nr, c:c + nc] = b.view
    place(want, local, info)
    assert torch.equal(got, want)
    empty = ShardInfo((7, 8), (((3, 0),),))  # an FSDP shard with no rows: nothing to write
    assert cd.boxes(torch.zeros(0, 8), empty) == []
    with pytest.raises(ValueError, match="does not match its place"):
        cd.boxes(torch.zeros(2, 8), info)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_per_replica_batch_norm_statistics_resume_bitwise(tmp_path):
    """`--bn-stats local`: the sample replicas' running statistics differ; DCP stores a copy held by
    several ranks once, so each rank also keeps its own copy of what the optimizer does not update,
    and a resume onto the same pieces reads it back: bitwise equal to the uninterrupted run."""
    from tests.train import _dcp_workers as w

    from hybridpar.train.launch import spawn

    uninterrupted = spawn(w.bn_local_run, 4, str(tmp_path), 4, False)  # checkpointed after step 2 on the way
    resumed = spawn(w.bn_local_run, 4, str(tmp_path), 4, True)
    stat = "stem.bn.running_mean"
    assert not torch.equal(uninterrupted[0][stat], uninterrupted[2][stat])  # replicas (0, 1) and (2, 3) differ
    for r in range(4):
        for k, v in uninterrupted[r].items():
            assert torch.equal(v, resumed[r][k]), (r, k)
