"""Sharded, atomic training checkpoints with resharding on load.

Layout of a checkpoint directory `D` (on a file system every rank sees):
    D/step-00000040/rank-00000.pt ... rank-000NN.pt   each rank's own shards + optimizer state + RNG
    D/step-00000040/manifest.json                     written last, by rank 0: step, world, plan, files
                                                      with their sizes and SHA-256
Atomicity: ranks write into `D/.tmp-step-00000040/`, fsync every file; after a barrier rank 0 writes
the manifest, fsyncs it and the directory, and renames the directory to `step-00000040` (an atomic
rename on POSIX). A kill at any moment leaves either no new directory or a complete one, and
`latest_checkpoint` only returns directories whose manifest and files check out.

Resharding: each rank file keeps, per tensor of the undistributed model's state_dict, this rank's
local tensor and where it sits in the full one (`ShardInfo`; None = the whole tensor). A resume
(`load_pieces`, after make_engine) memory-maps the rank files and gives each of the engine's local
tensors its piece: with the layout it was saved with, the same piece is in the rank's own file and
only its bytes are read; with another layout or rank count, that one tensor is reassembled from the
stored pieces and cut (one tensor at a time, never the whole model). `--init-from` reads a rank's
pieces of an undistributed state_dict file the same way (`load_init_pieces`). With the same layout
the pieces are the same bytes: a resumed run is bitwise equal to an uninterrupted one.

Ownership: a checkpoint directory belongs to one run. The manifest carries the run's identity (model,
data, seed, batch, optimizer settings: everything but the layout and the step count) and its digest
`run_id`; `check_checkpoint_dir` refuses a directory holding another run's checkpoints (unless told to
overwrite them), pruning keeps only this run's newest good checkpoints, and `lock_directory` takes an
advisory lock (flock on `D/.hybridpar.lock`) so that two runs cannot write into one directory.

Trust: a checkpoint directory is data, never code. Rank files are read with
`torch.load(weights_only=True)` (tensors, plain containers and `ShardInfo` only); the manifest
carries a SHA-256 over its own canonical JSON (`manifest_sha256`), its step must be the one in its
directory's name and its file entries exactly `rank-NNNNN.pt` of that directory, so one flipped bit
or a hand-edited manifest is skipped, never resumed; a manifest without a run identity is never
adopted by a resume; pruning removes only checkpoints whose manifest checks out and names this run;
the lock file is opened without following symlinks, and a run whose lock file is gone (the directory
deleted or replaced under it) stops before it writes or prunes anything.

Two storage formats under the same directory, manifest, lock and pruning. Layouts whose state is
sharded (channel/filter pieces, FSDP `zero=2|3` shards, their composition) write the step directory
as a torch.distributed.checkpoint (DCP) directory (manifest version 2, hybridpar.train.checkpoint_dcp):
each rank its pieces as chunks of the full tensors, resharded on load by DCP itself, readable by
torch's own `dcp.load`. Layouts whose every tensor is whole on every rank (sample-only, replicated)
and model-parallel stages keep the rank files above (version 1): there is nothing to reshard, rank 0's
file alone is the model, and the own reader stays anyway for the checkpoints written before DCP.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.errors import UserError
from hybridpar.parallel.state import ShardInfo, place, take

FORMAT = "hybridpar-checkpoint"
VERSION = 1  # rank files (whole-tensor layouts)
VERSION_DCP = 2  # a torch.distributed.checkpoint directory (sharded layouts)
_STEP_DIR = re.compile(r"^step-(\d{8})$")
LOCK_FILE = ".hybridpar.lock"


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions); the previous one is intact."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int  # completed optimizer steps
    world_size: int
    manifest: dict


# -- whose checkpoints ------------------------------------------------------------------------------

def run_id(identity: dict) -> str:
    """Digest of a run's identity (a JSON-able dict): equal for the same run under any layout."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _owner_mismatch(manifest: dict, identity: dict) -> str | None:
    """None when `manifest` belongs to the run `identity` describes, else the first difference."""
    theirs = manifest.get("identity")
    if not isinstance(theirs, dict) or not isinstance(manifest.get("run_id"), str):
        return "no run identity (an older hybridpar's, or made by hand)"  # never adopted by a resume
    if manifest.get("run_id") == run_id(identity):
        return None
    for key in sorted(set(theirs) | set(identity)):
        if key in theirs and theirs.get(key) != identity.get(key):
            return f"{key}={theirs.get(key)!r}, this run has {key}={identity.get(key)!r}"
    return None if "run_id" not in manifest else "another run identity"


# -- what a rank holds ------------------------------------------------------------------------------

def local_tensors(engine) -> tuple[dict[str, torch.Tensor], dict[str, ShardInfo | None]]:
    """This rank's tensors keyed by the undistributed state_dict's names, and where each sits in the
    full tensor (None: the whole tensor). Knows the two engines' internals; one place to adapt."""
    state = getattr(engine, "state", None)
    if state is not None and hasattr(state, "shards"):  # channel/filter/sample engine
        from hybridpar.train.checkpoint_sharded import fsdp_shards

        tensors = engine.module.state_dict(keep_vars=True)
        return tensors, fsdp_shards(tensors, dict(state.shards()))  # zero=2|3: each rank its FSDP shard
    local = getattr(engine, "_local_state", None)  # MP engine: whole tensors of the owned layers
    if local is not None:
        return dict(local), {}
    raise TypeError(f"checkpoint: unsupported engine {type(engine).__name__}")


def _opt_state_by_name(tensors: dict[str, torch.Tensor], opt: torch.optim.Optimizer) -> dict[str, dict]:
    name_of = {id(t): k for k, t in tensors.items()}
    out = {}
    for p, st in opt.state.items():
        if id(p) not in name_of:
            raise RuntimeError("checkpoint: optimizer holds a tensor the engine does not report")
        out[name_of[id(p)]] = {k: (_plain(v).detach().cpu().clone() if torch.is_tensor(v) else v)
                               for k, v in st.items()}
    return out


# -- writing ----------------------------------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def save_checkpoint(root: str | os.PathLike, step: int, engine, optimizer: torch.optim.Optimizer, *,
                    meta: dict | None = None, keep: int = 2, overwrite: bool = False) -> Path:
    """Collective: every rank writes its shards; returns the committed directory. Keeps this run's
    newest `keep` checkpoints (0 = all; the run is `meta["run_id"]` when given) and removes other
    runs' checkpoints only when `overwrite`. A failed write (disk full, ...) raises
    CheckpointWriteError on every rank and leaves the previous checkpoints as they were."""
    root = Path(root)
    rank, world = dist.get_rank(), dist.get_world_size()
    name = f"step-{step:08d}"
    tmp, final = root / f".tmp-{name}", root / name
    failure = None
    if rank == 0:
        failure = _lock_lost(root)
    _agree(failure, tmp)  # a lost lock: every rank stops before anything is written
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a previous attempt killed mid-write
            tmp.mkdir()
        except OSError as err:
            failure = _write_failure(err, tmp)
    _agree(failure, tmp)
    tensors, shards = local_tensors(engine)
    sharded = _use_dcp(shards)
    if sharded:  # pieces: chunks of the full tensors in a DCP directory (checkpoint_dcp)
        failure, extra = _save_dcp(tmp, tensors, shards, optimizer)
    else:
        failure, extra = _save_rank_file(tmp, step, tensors, shards, optimizer), {}
    _agree(failure, tmp)  # every shard is on disk before the manifest names them
    if rank == 0:
        try:
            files = _dcp_files(tmp) if sharded else [
                {"rank": r, "file": _rank_file(r), "bytes": (tmp / _rank_file(r)).stat().st_size,
                 "sha256": _sha256(tmp / _rank_file(r))} for r in range(world)]
            manifest = {"format": FORMAT, "version": VERSION_DCP if sharded else VERSION, "step": step,
                        "world_size": world, "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
                        "files": files, **extra, **(meta or {})}
            manifest["manifest_sha256"] = manifest_digest(manifest)
            with (tmp / "manifest.json").open("w") as f:
                json.dump(manifest, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
        except OSError as err:
            failure = _write_failure(err, tmp / "manifest.json")
        if failure is None:
            failure = _lock_lost(root) or _not_replaceable(final, (meta or {}).get("run_id"), overwrite)
        if failure is None:
            if final.exists():  # same step saved again (a restarted run): replace it whole
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(root)
            _prune(root, keep, step, (meta or {}).get("run_id"), overwrite)
    _agree(failure, tmp)  # when this returns, the checkpoint is committed for every rank
    return final


def _use_dcp(shards: dict[str, ShardInfo | None]) -> bool:
    """DCP (version 2) when some tensor is a piece; rank files (version 1) when every one is whole."""
    return any(s is not None for s in shards.values())


def _save_rank_file(tmp: Path, step: int, tensors: dict, shards: dict, optimizer) -> str | None:
    """Version 1: this rank's tensors, optimizer state and RNG in rank-NNNNN.pt; a failure line or None."""
    rank = dist.get_rank()
    payload = {
        "step": step, "rank": rank, "world_size": dist.get_world_size(),
        "tensors": {k: _plain(t).detach().cpu().clone() for k, t in tensors.items()},
        "shards": shards,
        "optimizer": _opt_state_by_name(tensors, optimizer),
        "rng": torch.get_rng_state(),
    }
    path = tmp / _rank_file(rank)
    try:
        with path.open("wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as err:  # torch.save reports a full disk as a RuntimeError
        return _write_failure(err, path)
    return None


def _save_dcp(tmp: Path, tensors: dict, shards: dict, optimizer) -> tuple[str | None, dict]:
    """Version 2 (collective): every rank's pieces into DCP directory `tmp`; (failure line or None,
    what the manifest adds). The pieces are cut first and the ranks agree on that before DCP's
    collectives start, so that a rank refusing its state cannot leave the others waiting in DCP."""
    from hybridpar.train import checkpoint_dcp as cd

    pieces, failure = None, None
    scalars: list[str] = []
    updated = {id(p) for group in optimizer.param_groups for p in group["params"]}
    try:
        pieces, scalars = cd.pieces_of(tensors, shards, _opt_state_by_name(tensors, optimizer),
                                       {n for n, t in tensors.items() if id(t) in updated})
    except ValueError as err:
        failure = f"{tmp}: {err}"
    _agree(failure, tmp)
    assert pieces is not None  # (_agree raised otherwise)
    try:
        return None, cd.write_pieces(tmp, pieces, scalars, cd.pieces_digest(tensors, shards))
    except (OSError, RuntimeError, ValueError, cd.CheckpointException) as err:  # DCP: every rank raises
        return _write_failure(cd.unwrap(err), tmp), {}


def _dcp_files(tmp: Path) -> list[dict]:
    """The files DCP wrote into `tmp` (every rank's data file and `.metadata`), with sizes and hashes."""
    return [{"file": p.name, "bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(tmp.iterdir()) if p.name != "manifest.json"]


def _not_replaceable(final: Path, owner: str | None, overwrite: bool) -> str | None:
    """Why the existing `final` (the step directory about to be committed) must not be replaced, else
    None: only this run's own checkpoint of that step (or, with overwrite, another run's) is."""
    if not final.exists() and not final.is_symlink():
        return None
    if final.is_symlink() or not final.is_dir():
        return f"{final}: exists and is not a checkpoint directory; left as it is"
    try:
        m = read_manifest(final, verify_hashes=False)
    except UserError:
        return f"{final}: exists and is not a checkpoint of this run; left as it is"
    if m.get("run_id") == owner or overwrite:
        return None
    return f"{final}: holds another run's checkpoint; left as it is"


def _write_failure(err: BaseException, path: Path) -> str:
    text = str(err)
    full = isinstance(err, OSError) and err.errno == errno.ENOSPC or "No space left" in text
    why = "no space left on the device" if full else (err.strerror if isinstance(err, OSError) and err.strerror
                                                       else text.splitlines()[0][:200] if text else type(err).__name__)
    return f"{path}: {why}"


def _agree(failure: str | None, tmp: Path) -> None:
    """A barrier that also tells every rank whether any rank failed to write; all raise together.
    A lost lock (`_lock_lost`): nothing in the directory is touched, not even `tmp`."""
    failed = [None] * dist.get_world_size()
    dist.all_gather_object(failed, failure)
    bad = [f for f in failed if f]
    if bad and bad[0].startswith(_LOCK_LOST):
        raise CheckpointWriteError(bad[0])
    if bad:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"could not write checkpoint {tmp.name.removeprefix('.tmp-')} ({bad[0]}); "
                                   "the previous checkpoints are intact")


def _prune(root: Path, keep: int, step: int, owner: str | None, overwrite: bool = False) -> None:
    """After committing `step`: keep it and this run's newest good checkpoints before it (`keep` in
    all); remove this run's other checkpoints (older ones and any later ones, a timeline this run
    has left by resuming from before them), half-written `.tmp-*` directories, and other runs'
    checkpoints only when `overwrite`. A directory whose manifest does not check out (a user's
    files, another version's checkpoint, one being copied in) is never removed: it is not provably
    this run's."""
    kept = 0
    for path in sorted((p for p in root.iterdir() if _STEP_DIR.match(p.name)), reverse=True):
        n = int(path.name[5:])
        if path.is_symlink() or not path.is_dir():
            continue
        try:
            m = read_manifest(path, verify_hashes=False)
        except UserError:
            continue
        mine = m.get("run_id") == owner  # (no owner: the caller's manifests carry no run_id either)
        if not mine:
            if overwrite:
                shutil.rmtree(path, ignore_errors=True)
            continue
        if n <= step and (keep <= 0 or kept < keep):
            kept += 1
            continue
        shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(".tmp-step-*"):
        if not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


# -- finding and checking ---------------------------------------------------------------------------

def read_manifest(path: Path, *, verify_hashes: bool = True) -> dict:
    """The manifest of a checkpoint directory, checked against its files; UserError if incomplete."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"checkpoint {path}: no readable manifest.json ({type(err).__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"checkpoint {path}: not a hybridpar checkpoint")
    version = manifest.get("version")
    if version not in (VERSION, VERSION_DCP) or isinstance(version, bool):
        raise UserError(f"checkpoint {path}: version {version!r} unsupported (reads {VERSION} and {VERSION_DCP})")
    if manifest.get("manifest_sha256") != manifest_digest(manifest):
        raise UserError(f"checkpoint {path}: manifest.json does not match its checksum (damaged or edited)")
    named = _STEP_DIR.match(path.name)
    step = manifest.get("step")
    if not _is_count(step) or (named is not None and int(named.group(1)) != step):
        raise UserError(f"checkpoint {path}: the manifest's step {step!r} is not its directory's")
    files = manifest.get("files")
    world = manifest.get("world_size")
    if not _is_count(world) or world < 1 or not isinstance(files, list) or (
            len(files) != world if version == VERSION else not files):
        raise UserError(f"checkpoint {path}: manifest lists {len(files) if isinstance(files, list) else 0} "
                        f"files for {world} ranks")
    for r, f in enumerate(files):
        _check_entry(path, version, files, r)
        p = path / f["file"]
        if p.is_symlink() or not p.is_file() or p.stat().st_size != f.get("bytes"):
            raise UserError(f"checkpoint {path}: {f.get('file')} missing or truncated")
        if verify_hashes and _sha256(p) != f.get("sha256"):
            raise UserError(f"checkpoint {path}: {f.get('file')} does not match its SHA-256")
    return manifest


def _check_entry(path: Path, version: int, files: list, r: int) -> None:
    """Entry `r` of a manifest's file list names a file of this directory in its version's format:
    `rank-NNNNN.pt` for rank r (version 1); a DCP data file or `.metadata`, each once (version 2)."""
    f = files[r]
    if version == VERSION:
        if not isinstance(f, dict) or f.get("file") != _rank_file(r) or f.get("rank") != r:
            raise UserError(f"checkpoint {path}: manifest entry {r} is not {_rank_file(r)} of this directory")
        return
    from hybridpar.train.checkpoint_dcp import DATA_FILE, METADATA

    names = [g.get("file") if isinstance(g, dict) else None for g in files]
    name = names[r]
    if not isinstance(name, str) or not (name == METADATA or DATA_FILE.match(name)) or names.count(name) > 1:
        raise UserError(f"checkpoint {path}: manifest entry {r} is not a DCP file of this directory")
    if METADATA not in names:
        raise UserError(f"checkpoint {path}: manifest lists no {METADATA}")


def manifest_digest(manifest: dict) -> str:
    """SHA-256 of a manifest's canonical JSON (sorted keys, no spaces), its own checksum left out."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _candidates(root: Path) -> Iterator[Path]:
    # A step directory that is a symlink is never read: it can point outside the checkpoint
    # directory (another run's files, a loop); symlinked_steps names them for a note.
    if root.is_dir():
        yield from sorted((p for p in root.iterdir() if _STEP_DIR.match(p.name) and not p.is_symlink()
                           and p.is_dir()), reverse=True)


def symlinked_steps(root: Path) -> list[str]:
    """Names of the step-NNNNNNNN entries of `root` that are symlinks (ignored; see _candidates)."""
    return sorted(p.name for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_symlink()) \
        if root.is_dir() else []


def latest_checkpoint(root: str | os.PathLike, *, verify_hashes: bool = True,
                      skipped: list[tuple[str, str]] | None = None, owner: str | None = None
                      ) -> CheckpointInfo | None:
    """The newest complete checkpoint under `root` (of run `owner`, when given), or None. Incomplete
    or corrupt ones are skipped; `skipped` (a list, when given) receives (directory name, why)."""
    for path in _candidates(Path(root)):
        try:
            m = read_manifest(path, verify_hashes=verify_hashes)
        except UserError as err:
            if skipped is not None:
                skipped.append((path.name, str(err).split(": ", 1)[-1]))
            continue
        if owner is not None and m.get("run_id") != owner:
            continue
        return CheckpointInfo(path, int(m["step"]), int(m["world_size"]), m)
    return None


def checkpoint_info(path: str | os.PathLike, *, verify_hashes: bool = False) -> CheckpointInfo:
    """The checkpoint in directory `path` (UserError if incomplete)."""
    path = Path(path)
    m = read_manifest(path, verify_hashes=verify_hashes)
    return CheckpointInfo(path, int(m["step"]), int(m["world_size"]), m)


@dataclass(frozen=True)
class DirCheck:
    """What `check_checkpoint_dir` found: the checkpoint to resume from (None: start at step 0) and
    one line per thing worth telling the user (checkpoints skipped and why, where the run starts)."""
    resume_from: CheckpointInfo | None
    notes: list[str] = field(default_factory=list)


RESUME_MODES = ("no", "yes", "if-any")


def check_checkpoint_dir(root: str | os.PathLike, identity: dict, resume: str = "no", *,
                         overwrite: bool = False) -> DirCheck:
    """Validate a checkpoint directory for the run `identity` before any process starts.

    resume="no": the directory must hold no checkpoints of this run or another (overwrite: they
    are replaced as this run saves). resume="yes": continue from this run's newest good checkpoint,
    start at step 0 when there is none, and refuse when every checkpoint there is damaged;
    "if-any": start at step 0 then too. Another run's checkpoints are refused unless `overwrite`."""
    if resume not in RESUME_MODES:
        raise UserError(f"resume must be one of {', '.join(RESUME_MODES)}, got {resume!r}", param="resume")
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise UserError(f"checkpoint_dir {root}: exists and is not a directory", param="checkpoint_dir")
    if not can_create_in(root if root.exists() else _existing_parent(root)):
        raise UserError(f"checkpoint_dir {root}: not writable", param="checkpoint_dir")
    me = run_id(identity)
    mine, damaged = [], []
    for path in _candidates(root):
        try:
            m = read_manifest(path, verify_hashes=False)
        except UserError as err:
            damaged.append((path.name, str(err).split(": ", 1)[-1]))
            continue
        why = _owner_mismatch(m, identity)
        if why is not None and not overwrite:
            raise UserError(f"checkpoint_dir {root} holds another run's checkpoints ({path.name} was made with "
                            f"{why}); use another directory, or overwrite them", param="checkpoint_dir")
        if why is None:
            mine.append(path)
    if resume == "no":
        if mine and not overwrite:
            raise UserError(f"checkpoint_dir {root} already holds this run's checkpoints (newest "
                            f"{mine[0].name}); resume from them, or overwrite them", param="checkpoint_dir")
        return DirCheck(None, [f"overwriting the checkpoints in {root}"] if overwrite and (mine or damaged) else [])
    notes = [f"skipping checkpoint {name}: {why}" for name, why in damaged]
    links = [f"ignoring {name}: a symlink, not a checkpoint directory" for name in symlinked_steps(root)]
    for path in mine:
        try:
            m = read_manifest(path, verify_hashes=True)
        except UserError as err:
            notes.append(f"skipping checkpoint {path.name}: {str(err).split(': ', 1)[-1]}")
            continue
        if m.get("run_id") != me:  # only this run's own manifests are resumed from
            continue
        info = CheckpointInfo(path, int(m["step"]), int(m["world_size"]), m)
        return DirCheck(info, [*sorted(notes), *links, f"resuming from step {info.step} ({path})"])
    if notes and resume == "yes":
        raise UserError(f"resume: every checkpoint in {root} is damaged ({'; '.join(sorted(notes))}); "
                        "resume if-any to start at step 0 anyway", param="resume")
    return DirCheck(None, [*sorted(notes), *links, f"no checkpoint of this run in {root}: starting at step 0"])


def can_create_in(folder: Path) -> bool:
    """Whether a file can be created in `folder` (tried, not guessed from mode bits: root, read-only
    mounts and pseudo file systems all fool os.access)."""
    import tempfile

    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".hybridpar-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(tmp)
    return True


def _existing_parent(path: Path) -> Path:
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path(".")


# -- one writer per directory ---------------------------------------------------------------------

_LOCKS: dict[str, int] = {}  # path -> open descriptor holding the flock, for this process's lifetime


def lock_directory(root: str | os.PathLike) -> None:
    """Take the advisory lock of checkpoint directory `root` for the rest of this process (created if
    missing). UserError when another live process holds it. The kernel drops the lock when the
    holder exits, however it exits."""
    import fcntl
    import stat

    root = Path(root)
    key = str(root.resolve())
    if key in _LOCKS:
        return
    lock = root / LOCK_FILE
    nofollow = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        root.mkdir(parents=True, exist_ok=True)
        try:  # a new lock file: created here, never through a link someone left
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | nofollow, 0o666)
        except FileExistsError:
            fd = os.open(lock, os.O_RDWR | nofollow)
    except OSError as err:
        why = "it is a symlink" if err.errno == errno.ELOOP else err.strerror
        raise UserError(f"checkpoint_dir {root}: cannot open its lock file {LOCK_FILE} ({why})",
                        param="checkpoint_dir") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"checkpoint_dir {root}: its lock file {LOCK_FILE} is not a regular file",
                        param="checkpoint_dir")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise UserError(f"checkpoint_dir {root} is in use by another run (pid {holder}); two runs cannot "
                        "share a checkpoint directory", param="checkpoint_dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _LOCKS[key] = fd
    _remember_lock(key, fd)


LOCK_ENV = "HYBRIDPAR_CHECKPOINT_LOCKS"  # {resolved dir: [st_dev, st_ino] of its lock file}; ranks inherit it
_LOCK_LOST = "checkpoint directory lock lost"


def _remember_lock(key: str, fd: int) -> None:
    st = os.fstat(fd)
    held = _held_locks()
    held[key] = [st.st_dev, st.st_ino]
    os.environ[LOCK_ENV] = json.dumps(held)


def _held_locks() -> dict:
    try:
        held = json.loads(os.environ.get(LOCK_ENV, "{}"))
    except ValueError:
        return {}
    return held if isinstance(held, dict) else {}


def _lock_lost(root: Path) -> str | None:
    """A line when this process (or the launcher that started it) locked `root` and that lock file
    is no longer there (the directory was deleted, moved or replaced under the run), else None: a
    run that lost its lock must not write or prune, another writer may own the directory now."""
    try:
        key = str(root.resolve())
    except OSError:
        return None
    want = _held_locks().get(key)
    if not want:
        return None
    try:
        st = os.lstat(root / LOCK_FILE)
        if [st.st_dev, st.st_ino] == list(want):
            return None
    except OSError:
        pass
    return (f"{_LOCK_LOST}: {root}/{LOCK_FILE} is gone or replaced (the directory was deleted or moved "
            "during the run); stopped without writing or pruning there")


def unlock_directory(root: str | os.PathLike) -> None:
    key = str(Path(root).resolve())
    held = _held_locks()
    if held.pop(key, None) is not None:
        os.environ[LOCK_ENV] = json.dumps(held)
    fd = _LOCKS.pop(key, None)
    if fd is not None:
        os.close(fd)


# -- loading ----------------------------------------------------------------------------------------

def _load_rank_file(info: CheckpointInfo, r: int, *, mmap: bool = False) -> dict:
    """Rank file `r` of a checkpoint, read as data: weights_only (tensors, containers, ShardInfo)."""
    path = info.path / _rank_file(r)
    try:
        with torch.serialization.safe_globals([ShardInfo]):
            part = mmap_load(path, weights_only=True) if mmap else torch.load(path, map_location="cpu",
                                                                               weights_only=True)
    except Exception as err:  # noqa: BLE001 - a refused or damaged file fails in many ways in torch.load
        why = "holds objects other than tensors" if "Weights only load failed" in str(err) else type(err).__name__
        raise UserError(f"checkpoint {info.path}: {_rank_file(r)} is not a hybridpar rank file ({why})") from None
    if not isinstance(part, dict) or not all(isinstance(part.get(k), dict) for k in ("tensors", "shards", "optimizer")):
        raise UserError(f"checkpoint {info.path}: {_rank_file(r)} is not a hybridpar rank file")
    return part


def _load_rank_files(info: CheckpointInfo) -> list[dict]:
    return [_load_rank_file(info, r) for r in range(len(info.manifest["files"]))]


def full_state(parts: list[dict], key: str = "tensors") -> dict[str, torch.Tensor]:
    """Reassemble undistributed tensors from every rank's pieces (`key`: tensors or optimizer slot)."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        items = part["tensors"].items() if key == "tensors" else (
            (k, st[key]) for k, st in part["optimizer"].items() if key in st)
        for name, t in items:
            info = part["shards"].get(name)
            if info is None:
                out.setdefault(name, t)
                continue
            if name not in out:
                out[name] = torch.zeros(info.full_shape, dtype=t.dtype)
            place(out[name], t, info)
    return out


def load_checkpoint(info: CheckpointInfo, module: nn.Module) -> dict:
    """Step 1 of a resume for an engine built from a whole module (model-parallel plans): put the
    checkpoint's undistributed weights into it before make_engine (which then cuts its own pieces).
    Reads every rank file whole; channel/filter/sample engines use `load_pieces` instead. Returns the
    rank files, for `restore_training_state`."""
    parts = None if _is_dcp(info) else _load_rank_files(info)
    weights = full_model_state(info) if parts is None else full_state(parts)
    try:
        module.load_state_dict(weights)
    except RuntimeError as err:
        lines = str(err).splitlines()
        raise UserError(f"checkpoint {info.path} does not match the model: "
                        f"{(lines[1] if len(lines) > 1 else lines[0]).strip()}") from None
    return {"info": info, "parts": parts}


def restore_training_state(loaded: dict, engine, optimizer: torch.optim.Optimizer, *,
                           restore_rng: bool = True) -> int:
    """Step 2, after make_engine: optimizer state (e.g. momentum) and RNG; returns the step to
    continue from. The optimizer state is cut for this engine at its first step (a pre-step hook):
    engines may settle a layer's shard shape only at the first forward. Each slot is read piece by
    piece (`_piece`): with the layout it was saved with, a rank reads only its own pieces."""
    info, parts = loaded["info"], loaded["parts"]
    if _is_dcp(info):
        from hybridpar.train import checkpoint_dcp as cd

        cd.restore_training_state(info.path, info.manifest, engine, optimizer, restore_rng=restore_rng)
        return info.step

    def sliced(v) -> bool:  # a per-element slot (momentum, Adam moments), cut like its parameter
        return torch.is_tensor(v) and v.dim() > 0

    slots = {s for p in parts for st in p["optimizer"].values() for s, v in st.items() if sliced(v)}
    scalars = {k: {s: v for s, v in st.items() if not sliced(v)}  # counts such as AdamW's step
               for p in parts for k, st in p["optimizer"].items()}
    own = dist.get_rank() if info.world_size == dist.get_world_size() else 0

    def apply(opt, _args, _kwargs) -> None:
        handle.remove()
        tensors, shards = local_tensors(engine)
        by_id = {id(t): n for n, t in tensors.items()}
        for group in opt.param_groups:
            for p in group["params"]:
                name = by_id.get(id(p))
                got = {s: _piece(parts, name, shards.get(name), s, own) for s in slots}
                st = {s: _like(p, v) for s, v in got.items() if v is not None}
                for s, v in st.items():
                    if v.shape != p.shape:
                        raise UserError(f"checkpoint {info.path}: optimizer {s} of {name} has shape "
                                        f"{tuple(v.shape)}, the parameter {tuple(p.shape)}")
                if st:
                    opt.state[p] = {**scalars.get(name, {}), **st}

    handle = optimizer.register_step_pre_hook(apply)
    if restore_rng and info.world_size == dist.get_world_size():
        torch.set_rng_state(parts[dist.get_rank()]["rng"])
    return info.step


# -- reading only a rank's own pieces ---------------------------------------------------------------

READ_BYTES = [0]  # bytes of stored tensors this process has copied out of checkpoint and --init-from files


def mmap_load(path, **kw):
    """torch.load with the file memory-mapped: only the pages of the tensors used are read
    (a file in torch's legacy format cannot be mapped: read whole)."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, **kw)
    except RuntimeError as err:
        if "mmap" not in str(err):
            raise
        return torch.load(path, map_location="cpu", **kw)


def _plain(t):
    """A replicated DTensor's local tensor (the whole tensor), an FSDP shard's local rows (its ShardInfo
    says where they sit: checkpoint_sharded); anything else as it is."""
    from torch.distributed.tensor import DTensor

    from hybridpar.train.checkpoint_sharded import is_fsdp_shard

    if is_fsdp_shard(t):
        return t.to_local()
    if isinstance(t, DTensor):
        if not all(p.is_replicate() for p in t.placements):
            return t.full_tensor()
        return t.to_local()
    return t


def _read(t: torch.Tensor) -> torch.Tensor:
    READ_BYTES[0] += t.numel() * t.element_size()
    return t


def _stored(part: dict, name: str, key: str):
    t = part["tensors"].get(name) if key == "tensors" else part["optimizer"].get(name, {}).get(key)
    return _plain(t) if torch.is_tensor(t) else None


def _piece(parts: list[dict], name: str | None, info: ShardInfo | None, key: str = "tensors",
           own: int = 0) -> torch.Tensor | None:
    """This rank's piece (`info`; None: whole) of tensor `name` (key "tensors", or an optimizer slot)
    from the stored parts, reading as little as it can: the same piece stored (the same layout; own
    rank's file first), else cut from a whole copy, else (another layout) that one tensor reassembled
    from the stored pieces and cut. None when no part holds it."""
    if name is None:
        return None
    order = [parts[own], *parts[:own], *parts[own + 1:]] if own < len(parts) else parts
    found = [(t, p["shards"].get(name)) for p in order if (t := _stored(p, name, key)) is not None]
    if not found:
        return None
    for t, stored in found:
        if stored == info:
            return _read(t)
    for t, stored in found:
        if stored is None:
            return _read(take(t, info))
    full = torch.zeros(found[0][1].full_shape, dtype=found[0][0].dtype)
    for t, stored in found:
        place(full, _read(t), stored)
    return take(full, info)


def _like(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An optimizer slot for parameter `p` from the stored whole-or-piece `v`: a DTensor like `p`'s
    when `p` is one (SGD/AdamW mix a DTensor parameter only with DTensor slots)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from hybridpar.train.checkpoint_sharded import is_fsdp_shard, like_shard

    if is_fsdp_shard(p):
        return like_shard(p, v)
    if not isinstance(p, DTensor):
        return v.to(p.device).clone()
    if all(pl.is_replicate() for pl in p.placements):
        return DTensor.from_local(v.to(p.device).clone(), p.device_mesh, p.placements, run_check=False)
    return distribute_tensor(v.to(p.device), p.device_mesh, p.placements)


def _assign(target: torch.Tensor, src: torch.Tensor, name: str, where: str) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    from hybridpar.train.checkpoint_sharded import is_fsdp_shard

    if isinstance(target, DTensor) and not is_fsdp_shard(target) \
            and not all(p.is_replicate() for p in target.placements):
        src = distribute_tensor(src.to(target.device), target.device_mesh, target.placements)
    else:
        target = _plain(target)
    if tuple(src.shape) != tuple(target.shape):
        raise UserError(f"{where} does not match the model: {name} has shape {tuple(src.shape)} there, "
                        f"this rank's piece of it {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(src)


def _check_names(theirs, ours, where: str) -> None:
    missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    if missing or extra:
        what = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(extra[:3])}"
        raise UserError(f"{where} does not match the model: {what}")


def load_init_pieces(path: str | os.PathLike, engine) -> None:
    """`--init-from` after make_engine: this rank's pieces of an undistributed state_dict file
    (memory-mapped: a rank reads its pieces' bytes, not the file)."""
    state = mmap_load(path, weights_only=True)
    tensors, shards = local_tensors(engine)
    _check_names(state, tensors, f"init_from {path}")
    for name, t in tensors.items():
        _assign(t, _read(take(state[name], shards.get(name))), name, f"init_from {path}")


def load_pieces(info: CheckpointInfo, engine) -> dict:
    """A resume after make_engine: this rank's pieces of the checkpoint's weights, read from the
    memory-mapped rank files (the same layout: its own file's pieces only; another layout: one tensor
    at a time). Returns the mapped rank files, for `restore_training_state`. A DCP checkpoint (version 2):
    DCP reads the stored chunks that overlap this rank's pieces (checkpoint_dcp)."""
    if _is_dcp(info):
        from hybridpar.train import checkpoint_dcp as cd

        cd.load_pieces(info.path, info.manifest, engine)
        return {"info": info, "parts": None}
    parts = [_load_rank_file(info, r, mmap=True) for r in range(len(info.manifest["files"]))]
    tensors, shards = local_tensors(engine)
    own = dist.get_rank() if info.world_size == dist.get_world_size() else 0
    _check_names(parts[0]["tensors"], tensors, f"checkpoint {info.path}")
    for name, t in tensors.items():
        _assign(t, _piece(parts, name, shards.get(name), "tensors", own), name, f"checkpoint {info.path}")
    return {"info": info, "parts": parts}


def full_model_state(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The undistributed model's state_dict stored in a checkpoint (no process group needed)."""
    if _is_dcp(info):
        from hybridpar.train import checkpoint_dcp as cd

        return cd.full_model_state(info.path, info.manifest)
    return full_state(_load_rank_files(info))


def _is_dcp(info: CheckpointInfo) -> bool:
    return info.manifest.get("version") == VERSION_DCP

