"""Sharded atomic checkpoints: bitwise resume, resharding on load, and kills at every point of a save."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch.multiprocessing import ProcessExitedException

from hybridpar.errors import UserError
from hybridpar.train import checkpoint as ckpt
from hybridpar.train.launch import spawn

from .ckpt_worker import CRASH_ENV, train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 6


def _run(root, strategy="channel=2", world=2, steps=STEPS, every=0, resume=False, stop_after=None):
    return spawn(train, world, str(root), strategy, world, steps, every, resume, stop_after)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Six SGD-with-momentum steps of small_cnn under channel=2 (sharded weights) on 2 ranks."""
    return _run(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """The same run, checkpointing every 2 steps, stopped after 4."""
    root = tmp_path_factory.mktemp("interrupted")
    return root, _run(root, every=2, stop_after=4)


@pytest.fixture
def ckpt_dir(tmp_path, interrupted):
    shutil.copytree(interrupted[0], tmp_path / "ck")
    return tmp_path / "ck"


def test_resume_same_layout_is_bitwise_equal(ckpt_dir, interrupted, uninterrupted):
    info = ckpt.latest_checkpoint(ckpt_dir)
    assert info is not None and info.step == 4 and info.world_size == 2
    # channel=2 holds sharded weights: a torch.distributed.checkpoint directory (train.checkpoint_dcp)
    assert sorted(p.name for p in info.path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]
    resumed = _run(ckpt_dir, resume=True)
    assert resumed["start"] == 4
    assert interrupted[1]["losses"] + resumed["losses"] == uninterrupted["losses"]
    for k, v in uninterrupted["state"].items():
        assert torch.equal(v, resumed["state"][k]), k


def test_resume_with_another_layout_and_rank_count(ckpt_dir, uninterrupted):
    resumed = _run(ckpt_dir, strategy="sample=1", world=1, resume=True)  # channel=2 on 2 -> 1 rank
    assert resumed["start"] == 4
    for k, v in uninterrupted["state"].items():
        torch.testing.assert_close(resumed["state"][k], v, rtol=1e-4, atol=1e-5, msg=k)
    # The shards reassemble into the undistributed state_dict, which a plain module loads.
    from hybridpar.graph.models import load_model

    load_model("small_cnn").module.load_state_dict(ckpt.full_model_state(ckpt.latest_checkpoint(ckpt_dir)))


def test_corrupt_or_incomplete_newest_checkpoint_is_skipped(ckpt_dir):
    newest = ckpt.latest_checkpoint(ckpt_dir)
    assert newest.step == 4 and (ckpt_dir / "step-00000002").is_dir()
    shard = newest.path / "__1_0.distcp"  # rank 1's DCP data file
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte: only the hash can tell
    shard.write_bytes(bytes(data))
    assert ckpt.latest_checkpoint(ckpt_dir).step == 2
    with pytest.raises(UserError, match="SHA-256"):
        ckpt.read_manifest(newest.path)
    shard.write_bytes(bytes(data[:100]))
    with pytest.raises(UserError, match="truncated"):
        ckpt.read_manifest(newest.path)
    (newest.path / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(UserError, match="not a hybridpar checkpoint"):
        ckpt.read_manifest(newest.path)
    (newest.path / "manifest.json").unlink()
    assert ckpt.latest_checkpoint(ckpt_dir).step == 2


@pytest.mark.parametrize("point", ["mid-shard", "before-manifest", "before-rename", "after-rename"])
def test_kill_during_save_leaves_last_complete_checkpoint(ckpt_dir, monkeypatch, point):
    """Rank 0 dies (os._exit, no cleanup) at each point of saving step 6; one rank keeps it cheap."""
    monkeypatch.setenv(CRASH_ENV, point)
    with pytest.raises(ProcessExitedException):
        _run(ckpt_dir, strategy="sample=1", world=1, every=2, resume=True)
    info = ckpt.latest_checkpoint(ckpt_dir)
    assert info is not None and info.step == (6 if point == "after-rename" else 4)
    ckpt.read_manifest(info.path)  # complete: every file there with its size and hash
    assert ckpt.full_model_state(info)  # and loadable
    if point == "before-rename":  # the next save clears the half-written directory
        monkeypatch.delenv(CRASH_ENV)
        done = _run(ckpt_dir, strategy="sample=1", world=1, every=2, steps=8, resume=True)
        assert done["start"] == 4 and ckpt.latest_checkpoint(ckpt_dir).step == 8
        assert not [p for p in ckpt_dir.iterdir() if p.name.startswith(".tmp-")]
