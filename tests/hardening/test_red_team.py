"""Issue 33's red-team list, items 1-8: each reproducer as a test (each failed before its fix)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridpar.cli.main import main
from hybridpar.errors import UserError
from hybridpar.files import atomic_write
from hybridpar.parallel.state import ShardInfo
from hybridpar.train import checkpoint as ckpt

pytestmark = pytest.mark.timeout(300)

ONE = ["train", "--model", "small_cnn", "--strategy", "sample=1", "--nproc", "1", "--batch", "8"]
IDENTITY = {"model": "m", "seed": 0}
ME = ckpt.run_id(IDENTITY)


def _fake_checkpoint(root: Path, step: int, *, run: str | None = ME, identity: dict | None = IDENTITY,
                     payload=None) -> Path:
    """A one-rank checkpoint as save_checkpoint writes it (rank file, then a checksummed manifest)."""
    d = root / f"step-{step:08d}"
    d.mkdir(parents=True)
    if payload is None:
        payload = {"step": step, "rank": 0, "world_size": 1, "tensors": {"w": torch.full((2,), float(step))},
                   "shards": {"w": ShardInfo((2,), (None,))}, "optimizer": {}, "rng": torch.get_rng_state()}
    torch.save(payload, d / "rank-00000.pt")
    m = {"format": ckpt.FORMAT, "version": ckpt.VERSION, "step": step, "world_size": 1,
         "files": [{"rank": 0, "file": "rank-00000.pt", "bytes": (d / "rank-00000.pt").stat().st_size,
                    "sha256": ckpt._sha256(d / "rank-00000.pt")}]}
    if run is not None:
        m.update(identity=identity, run_id=run)
    m["manifest_sha256"] = ckpt.manifest_digest(m)
    (d / "manifest.json").write_text(json.dumps(m, indent=2))
    return d


def _one_line(code: int, err: str, needle: str, want: int = 2) -> None:
    assert code == want, err
    assert err.startswith("hybridpar: error:") and err.count("\n") == 1 and needle in err, err


# -- 1. resuming never runs code ----------------------------------------------------------------------

class _Boom:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_rank_file_holding_code_is_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    d = _fake_checkpoint(tmp_path / "ck", 2, payload={"step": 2, "rank": 0, "world_size": 1, "tensors": {},
                                                       "shards": {}, "optimizer": {}, "rng": _Boom(str(marker))})
    info = ckpt.checkpoint_info(d)
    with pytest.raises(UserError, match="rank-00000.pt is not a hybridpar rank file"):
        ckpt.full_model_state(info)
    assert not marker.exists()
    ok = _fake_checkpoint(tmp_path / "ck", 4)  # a real one still loads (ShardInfo is allowed)
    assert torch.equal(ckpt.full_model_state(ckpt.checkpoint_info(ok))["w"], torch.full((2,), 4.0))


def test_a_manifest_without_this_runs_identity_is_not_adopted(tmp_path):
    root = tmp_path / "ck"
    _fake_checkpoint(root, 2, run=None)  # no identity: an older hybridpar's, or someone else's
    with pytest.raises(UserError, match="holds another run's checkpoints .*no run identity"):
        ckpt.check_checkpoint_dir(root, IDENTITY, "yes")
    found = ckpt.check_checkpoint_dir(root, IDENTITY, "if-any", overwrite=True)
    assert found.resume_from is None  # told to overwrite it: still never resumed from
    _fake_checkpoint(root, 4)
    assert ckpt.check_checkpoint_dir(root, IDENTITY, "yes", overwrite=True).resume_from.step == 4


@pytest.mark.parametrize("entry", ["../../outside.pt", "/etc/passwd", "rank-00001.pt"])
def test_manifest_file_entries_cannot_point_outside_the_directory(tmp_path, entry):
    d = _fake_checkpoint(tmp_path / "ck", 2)
    m = json.loads((d / "manifest.json").read_text())
    m["files"][0]["file"] = entry
    m["manifest_sha256"] = ckpt.manifest_digest(m)  # a well-formed manifest, checksum and all
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="entry 0 is not rank-00000.pt of this directory"):
        ckpt.read_manifest(d)
    assert ckpt.latest_checkpoint(tmp_path / "ck") is None


# -- 2 and 3. --data npy:DIR and file.py:factory with loader workers ----------------------------------

@pytest.mark.slow
def test_npy_data_trains(tmp_path, capsys):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.standard_normal((16, 3, 32, 32)).astype(np.float32))
    np.save(tmp_path / "y.npy", rng.integers(0, 10, 16))
    code = main([*ONE, "--steps", "2", "--data", f"npy:{tmp_path}", "--json"])
    assert code == 0, capsys.readouterr().err


@pytest.mark.slow
def test_factory_data_trains_with_spawned_loader_workers(tmp_path, capsys):
    (tmp_path / "mydata.py").write_text(
        "import torch\n"
        "class Items(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n        return 16\n"
        "    def __getitem__(self, i):\n        return torch.full((3, 32, 32), float(i)), i % 10\n"
        "def make():\n    return Items()\n")
    code = main([*ONE, "--steps", "2", "--data", f"{tmp_path / 'mydata.py'}:make", "--workers", "1", "--json"])
    assert code == 0, capsys.readouterr().err


def test_a_factory_data_set_survives_pickling_into_a_fresh_interpreter(tmp_path):
    """What a spawned loader worker does, without training: unpickle in a process that never
    imported the user's file."""
    import pickle
    import subprocess

    from hybridpar.train.data.files import from_factory

    (tmp_path / "mydata2.py").write_text(
        "import torch\n"
        "class Items(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n        return 4\n"
        "    def __getitem__(self, i):\n        return torch.zeros(3, 8, 8), 1\n"
        "def make():\n    return Items()\n")
    ds = from_factory(f"{tmp_path / 'mydata2.py'}:make", (3, 8, 8))
    blob = tmp_path / "ds.pkl"
    blob.write_bytes(pickle.dumps(ds))
    out = subprocess.run([sys.executable, "-c", f"import pickle; ds = pickle.load(open({str(blob)!r}, 'rb')); "
                          "print(len(ds), int(ds[2][1]))"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["4", "1"], out.stderr[-800:]


# -- 4. the lock file never follows a symlink ---------------------------------------------------------

@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlinked_lock_file_is_refused(tmp_path, dangling):
    root, target = tmp_path / "ck", tmp_path / "victim.txt"
    root.mkdir()
    if not dangling:
        target.write_text("precious\n")
    (root / ckpt.LOCK_FILE).symlink_to(target)
    with pytest.raises(UserError, match="cannot open its lock file .hybridpar.lock \\(it is a symlink\\)"):
        ckpt.lock_directory(root)
    assert (target.read_text() == "precious\n") if not dangling else not target.exists()


def test_the_lock_file_is_created_new(tmp_path):
    root = tmp_path / "ck"
    try:
        ckpt.lock_directory(root)
        lock = root / ckpt.LOCK_FILE
        assert stat.S_ISREG(os.lstat(lock).st_mode) and lock.read_text() == f"{os.getpid()}\n"
    finally:
        ckpt.unlock_directory(root)


# -- 5. pruning removes only this run's own checkpoints ------------------------------------------------

def test_pruning_keeps_what_is_not_provably_this_runs(tmp_path):
    root = tmp_path / "ck"
    for step in (2, 4, 6):
        _fake_checkpoint(root, step)
    (root / "step-00000001").mkdir()
    (root / "step-00000001" / "results.csv").write_text("a,b\n")  # a user's files
    newer = _fake_checkpoint(root, 3, run="another-run")  # another run's, and a newer format:
    m = json.loads((newer / "manifest.json").read_text())
    m["version"] = ckpt.VERSION + 1
    (newer / "manifest.json").write_text(json.dumps(m))
    copying = root / "step-00000005"  # another run's checkpoint half copied in: no manifest yet
    copying.mkdir()
    (copying / "rank-00000.pt").write_bytes(b"partial")
    _fake_checkpoint(root, 0, run="other")  # another run's, well-formed
    ckpt._prune(root, keep=1, step=6, owner=ME)
    left = sorted(p.name for p in root.iterdir())
    assert left == ["step-00000000", "step-00000001", "step-00000003", "step-00000005", "step-00000006"]
    assert (root / "step-00000001" / "results.csv").read_text() == "a,b\n"


# -- 6. outputs are written only to regular files or new paths ---------------------------------------

@pytest.mark.parametrize("kind", ["symlink", "fifo", "device"])
def test_save_refuses_what_is_not_a_regular_file(tmp_path, capsys, no_spawn, kind):
    target = tmp_path / "w.pt"
    if kind == "symlink":
        (tmp_path / "real.pt").write_text("keep")
        target.symlink_to(tmp_path / "real.pt")
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        target = Path("/dev/null")
    code = main([*ONE, "--steps", "1", "--save", str(target)])
    needle = {"symlink": "is a symlink", "fifo": "is a FIFO", "device": "is a device"}[kind]
    _one_line(code, capsys.readouterr().err, needle)
    assert kind != "symlink" or (target.is_symlink() and (tmp_path / "real.pt").read_text() == "keep")
    assert kind != "fifo" or stat.S_ISFIFO(os.lstat(target).st_mode)


def test_atomic_write_never_replaces_a_link_or_a_device(tmp_path):
    link = tmp_path / "out.json"
    link.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(UserError, match="is a symlink"):
        atomic_write(link, "{}")
    assert link.is_symlink() and not (tmp_path / "elsewhere.json").exists()
    with pytest.raises(UserError, match="is a device"):
        atomic_write("/dev/null", "{}")
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)
    atomic_write(tmp_path / "new.json", "{}")  # new paths and regular files are fine
    atomic_write(tmp_path / "new.json", "[]")
    assert (tmp_path / "new.json").read_text() == "[]"


# -- 7. one flipped bit in a manifest is never resumed silently ---------------------------------------

@pytest.mark.parametrize("edit", ["step", "bit", "unsigned"])
def test_a_damaged_manifest_is_skipped_to_the_previous_good_checkpoint(tmp_path, edit):
    root = tmp_path / "ck"
    _fake_checkpoint(root, 60)
    d = _fake_checkpoint(root, 70)
    text = (d / "manifest.json").read_text()
    if edit == "step":  # the case: "step 60" read as 70 (here 70 as 71), checksum recomputed
        m = json.loads(text)
        m["step"] = 71
        m["manifest_sha256"] = ckpt.manifest_digest(m)
        (d / "manifest.json").write_text(json.dumps(m))
    elif edit == "bit":  # one flipped bit anywhere in the JSON's values
        i = text.index('"world_size": 1') + len('"world_size": ')
        (d / "manifest.json").write_text(text[:i] + chr(ord(text[i]) ^ 0x02) + text[i + 1:])  # 1 -> 3
    else:  # a manifest without its checksum
        m = json.loads(text)
        del m["manifest_sha256"]
        (d / "manifest.json").write_text(json.dumps(m))
    skipped: list = []
    info = ckpt.latest_checkpoint(root, skipped=skipped)
    assert info.step == 60 and skipped and skipped[0][0] == "step-00000070"
    found = ckpt.check_checkpoint_dir(root, IDENTITY, "yes")
    assert found.resume_from.step == 60 and any("skipping checkpoint step-00000070" in n for n in found.notes)


# -- 8. a run whose checkpoint directory was deleted stops before writing or pruning -----------------

def test_a_lost_lock_is_noticed(tmp_path):
    root = tmp_path / "ck"
    try:
        ckpt.lock_directory(root)
        assert ckpt._lock_lost(root) is None
        shutil.rmtree(root)  # deleted mid-run; a second writer then takes the directory
        root.mkdir()
        (root / ckpt.LOCK_FILE).write_text("12345\n")
        _fake_checkpoint(root, 2, run="second-writer")
        assert "lock lost" in ckpt._lock_lost(root)
    finally:
        ckpt.unlock_directory(root)
    assert ckpt._lock_lost(root) is None  # unlocked: nothing remembered


@pytest.mark.slow
def test_a_run_whose_directory_is_deleted_stops_without_touching_the_new_writers_files(tmp_path):
    from hybridpar.train.launch import spawn

    from .ckpt_worker import lose_lock

    out = spawn(lose_lock, 1, str(tmp_path / "ck"))
    assert out["first"] == 1 and "checkpoint directory lock lost" in out["error"], out
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [ckpt.LOCK_FILE, "step-00000001"]
    assert (tmp_path / "ck" / "step-00000001" / "theirs.txt").read_text() == "theirs"
