"""`hybridpar train` hardening options are validated before any process starts (exit 2, one line)."""

import hashlib
import json

import pytest

from hybridpar.cli.main import main

BASE = ["train", "--model", "small_cnn", "--strategy", "sample=2", "--nproc", "2", "--steps", "2", "--batch", "8"]


def _fake_checkpoint(root, **meta):
    """A complete-looking checkpoint directory (manifest + one rank file with its size and hash)."""
    d = root / "step-00000002"
    d.mkdir(parents=True)
    (d / "rank-00000.pt").write_bytes(b"x" * 10)
    files = [{"rank": 0, "file": "rank-00000.pt", "bytes": 10, "sha256": hashlib.sha256(b"x" * 10).hexdigest()}]
    from hybridpar.train.checkpoint import manifest_digest

    manifest = json.loads(json.dumps({"format": "hybridpar-checkpoint", "version": 1, "step": 2, "world_size": 1,
                                      "files": files, **meta}))
    manifest["manifest_sha256"] = manifest_digest(manifest)  # well formed: refused for what it says alone
    (d / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(("extra", "message"), [
    (["--checkpoint-every", "2"], "need --checkpoint-dir"),
    (["--resume"], "need --checkpoint-dir"),
    (["--checkpoint-every", "-1", "--checkpoint-dir", "{tmp}/ck"], "must be >= 0"),
    (["--checkpoint-dir", "{tmp}/file"], "not a directory"),
    (["--checkpoint-dir", "{tmp}/ck", "--resume", "--seed", "3"], "seed=0"),
    (["--checkpoint-dir", "{tmp}/ck", "--resume", "--model", "small_resnet"], "model='small_cnn'"),
])
def test_bad_hardening_options_exit_2_before_spawn(tmp_path, capsys, no_spawn, extra, message):
    from hybridpar.train.checkpoint import run_id
    from hybridpar.train.config import run_config

    (tmp_path / "file").write_text("")
    identity = run_config(model="small_cnn", strategy="sample=2", batch=8, steps=2).config.identity
    _fake_checkpoint(tmp_path / "ck", identity=identity, run_id=run_id(identity))  # this run's, at seed 0
    argv = [a for a in BASE if a != "small_cnn" or "--model" not in extra]
    if "--model" in extra:
        argv.remove("--model")
    rc = main([*argv, *[a.replace("{tmp}", str(tmp_path)) for a in extra]])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and message in err, err
