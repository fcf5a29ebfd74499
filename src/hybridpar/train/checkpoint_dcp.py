"""Checkpoints of sharded state (channel/filter pieces, FSDP `zero=2|3` shards, their composition)
through torch.distributed.checkpoint (DCP), inside hybridpar's own checkpoint directory
(hybridpar.train.checkpoint: temp directory renamed into place, checksummed manifest, lock, pruning).

DCP stores every tensor as chunks — (offset, size) boxes of the logical, undistributed tensor — and on
load reads whatever stored chunks overlap the boxes a rank asks for. A rank's piece here is a ShardInfo
(per leading dim, the ranges it concatenates: uneven channel/filter cuts, strided stationary-w cuts,
FSDP's rows of either), i.e. the cartesian product of those ranges: one box each. So each rank writes
its boxes as DCP chunks of the full tensors (`_PieceSavePlanner`; copies held by several ranks are
written once, DCP's dedup) and a resume under any layout or rank count asks for its own boxes
(`_PieceLoadPlanner`): DCP's own resharding by overlap, reading only the stored chunks that overlap.

Keys (flat, so `torch.distributed.checkpoint.load({"model": model.state_dict()}, checkpoint_id=D)`
fills a plain model): `model.<name>` (weights, buffers), `optim.state.<name>.<slot>` (momentum, Adam
moments, step counts; a number that was not a tensor is stored as a 0-dim tensor and listed in the
manifest's `python_scalars`), `rng.rank-NNNNN` (each rank's CPU generator state),
`replica.rank-NNNNN.<name>` (each rank's own copy of what the optimizer does not update: copies held by
several ranks are stored once, and under `--bn-stats local` the replicas' batch-norm statistics differ;
a resume onto the same pieces, `rank_pieces` in the manifest, reads its own copy back).

Trust: DCP's FileSystemReader unpickles `.metadata` with plain `pickle.load` (code, if crafted). We
read it ourselves (`_CheckedReader`): the bytes are checked against the SHA-256 in our manifest, then
unpickled by an allow-list unpickler (DCP's metadata dataclasses, torch.Size, dtypes, nothing else),
and every data file it names must be one the manifest lists. Data files are read by DCP with
`torch.load(weights_only=True)`."""

from __future__ import annotations

import hashlib
import io
import itertools
import math
import os
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from hybridpar.errors import UserError
from hybridpar.parallel.state import ShardInfo

STORAGE = "torch.distributed.checkpoint"
METADATA = ".metadata"
DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")


def model_key(name: str) -> str:
    return f"model.{name}"


def optim_key(name: str, slot: str) -> str:
    return f"optim.state.{name}.{slot}"


def rng_key(rank: int) -> str:
    return f"rng.rank-{rank:05d}"


def replica_key(rank: int, name: str) -> str:
    return f"replica.rank-{rank:05d}.{name}"


def pieces_digest(tensors: dict, shards: dict[str, ShardInfo | None]) -> str:
    """Which pieces a rank holds (names and places): equal when a resume gives it the same pieces."""
    text = repr(sorted((n, shards.get(n)) for n in tensors))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# -- a piece as boxes of the full tensor ------------------------------------------------------------

@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]  # in the full tensor
    sizes: tuple[int, ...]
    view: torch.Tensor  # the rank's local tensor at this box (a view: reads write into it)


def boxes(local: torch.Tensor, info: ShardInfo | None) -> list[Box]:
    """The boxes of the full tensor that `local` (the piece `info` describes; None: all of it)
    concatenates, each with its view of `local`. Empty boxes are left out, except for a tensor with
    no elements, stored as one empty box (DCP needs a chunk per tensor). The views are of `local`
    detached (its storage: a parameter's, an FSDP shard's rows), outside autograd."""
    local = local.detach()
    full = tuple(local.shape) if info is None else tuple(info.full_shape)
    if info is None or math.prod(full) == 0:
        if tuple(local.shape) != full:
            raise ValueError(f"piece of shape {tuple(local.shape)} is not the whole {full}")
        return [Box((0,) * len(full), full, local)]
    per_dim = []
    for d, n in enumerate(full):
        given = info.dims[d] if d < len(info.dims) else None
        rs = given if given is not None else ((0, n),)
        at, ranges = 0, []
        for off, size in rs:
            ranges.append((off, size, at))
            at += size
        if at != local.shape[d]:
            raise ValueError(f"piece of shape {tuple(local.shape)} does not match its place {info}")
        per_dim.append(ranges)
    out = []
    for combo in itertools.product(*per_dim):
        if any(size == 0 for _, size, _ in combo):
            continue
        view = local
        for d, (_, size, at) in enumerate(combo):
            view = view.narrow(d, at, size)
        out.append(Box(tuple(c[0] for c in combo), tuple(c[1] for c in combo), view))
    return out


Pieces = dict[str, tuple[tuple[int, ...], list[Box]]]  # key -> (the full tensor's shape, this rank's boxes)


# -- saving -------------------------------------------------------------------------------------------

class _PieceSavePlanner(DefaultSavePlanner):
    """Writes each rank's boxes as SHARD chunks; DefaultSavePlanner's global step dedups copies held by
    several ranks, builds the metadata and checks the chunks tile every tensor exactly."""

    def __init__(self, pieces: Pieces):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True)
        self.pieces = pieces  # key -> (full shape, boxes)
        self.views = {(k, b.offsets): b.view for k, (_, bs) in pieces.items() for b in bs}

    def set_up_planner(self, state_dict, storage_meta: StorageMeta | None = None, is_coordinator: bool = False):
        self.state_dict, self.is_coordinator = state_dict, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, (full, bs) in self.pieces.items():
            for b in bs:
                props = TensorProperties.create_from_tensor(b.view)
                items.append(WriteItem(index=MetadataIndex(key, torch.Size(b.offsets)), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(
                                           chunk=ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)),
                                           properties=props, size=torch.Size(full))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        return self.views[(write_item.index.fqn, tuple(write_item.index.offset or ()))].detach().cpu().contiguous()


def _plain(t):
    from hybridpar.train.checkpoint import _plain as plain

    return plain(t)


def pieces_of(tensors: dict[str, torch.Tensor], shards: dict[str, ShardInfo | None],
              optimizer_state: dict[str, dict], updated: set[str]) -> tuple[Pieces, list[str]]:
    """This rank's boxes of every key (weights, buffers, optimizer slots, its RNG state) and the
    `optim.state.*` keys that hold a number that was not a tensor. ValueError: state it cannot store.

    A copy several ranks hold is stored once (DCP's dedup), which is exact for what the optimizer
    updates (`updated`: the same on every replica). What it does not update (batch-norm running
    statistics: per replica under `--bn-stats local`) is also kept as this rank's own copy
    (`replica.rank-NNNNN.<name>`, small), which a resume onto the same pieces reads back."""
    import torch.distributed as dist

    pieces: Pieces = {}
    scalars: list[str] = []
    for name, t in tensors.items():
        local, info = _plain(t).detach().cpu(), shards.get(name)
        full = tuple(local.shape) if info is None else tuple(info.full_shape)
        pieces[model_key(name)] = (full, boxes(local, info))
        if name not in updated:
            pieces[replica_key(dist.get_rank(), name)] = (tuple(local.shape), boxes(local, None))
        for slot, v in optimizer_state.get(name, {}).items():
            key = optim_key(name, slot)
            if v is None:  # an unset slot (read back as absent: `state.get(slot)` is None either way)
                continue
            if not torch.is_tensor(v):
                if not isinstance(v, int | float | bool):
                    raise ValueError(f"optimizer state {slot} of {name} is a {type(v).__name__}, not a number")
                v = torch.tensor(v)
                scalars.append(key)
            if v.dim() == 0:  # a count (AdamW's step): the same on every rank
                pieces[key] = ((), boxes(v, None))
            elif tuple(v.shape) == tuple(local.shape):  # a per-element slot: cut like its parameter
                pieces[key] = (full, boxes(v, info))
            else:
                raise ValueError(f"optimizer state {slot} of {name} has shape {tuple(v.shape)}, "
                                 f"the parameter's piece {tuple(local.shape)}")
    rng = torch.get_rng_state()
    pieces[rng_key(dist.get_rank())] = (tuple(rng.shape), boxes(rng, None))
    return pieces, scalars


def write_pieces(tmp: Path, pieces: Pieces, scalars: list[str], digest: str) -> dict:
    """Collective: every rank's `pieces` into DCP directory `tmp`. Returns what the manifest adds:
    every rank's `scalars` merged and each rank's pieces `digest` (the same on every rank). Raises
    what DCP raised (CheckpointException: every rank)."""
    import torch.distributed as dist

    dcp.save({}, storage_writer=dcp.FileSystemWriter(tmp, thread_count=1), planner=_PieceSavePlanner(pieces))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (scalars, digest))
    return {"storage": STORAGE, "python_scalars": sorted({k for ks, _ in every for k in ks}),
            "rank_pieces": [d for _, d in every]}


def unwrap(err: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (itself otherwise)."""
    if isinstance(err, CheckpointException) and err.failures:
        return next(iter(err.failures.values()))[0]
    return err


# -- reading .metadata as data ------------------------------------------------------------------------

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch", "device"),
      ("torch.serialization", "_get_layout"),  # a layout's name -> torch.strided, ...: a table lookup
      ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
      ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata and nothing else: no function, no other class can be reached from the file."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(path: Path, manifest: dict) -> Metadata:
    """`.metadata` of checkpoint `path`, checked against the manifest's SHA-256 (the bytes read once,
    then checked, then unpickled from memory) and unpickled by the allow-list; every data file it names
    must be one the manifest lists. UserError otherwise."""
    listed = {f.get("file"): f for f in manifest.get("files", []) if isinstance(f, dict)}
    entry = listed.get(METADATA)
    try:
        with open(path / METADATA, "rb", opener=_nofollow) as f:
            data = f.read()
    except OSError as err:
        raise UserError(f"checkpoint {path}: {METADATA} unreadable ({err.strerror})") from None
    if entry is None or hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise UserError(f"checkpoint {path}: {METADATA} does not match its SHA-256")
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as err:  # noqa: BLE001 - a refused or damaged pickle fails in many ways
        raise UserError(f"checkpoint {path}: {METADATA} is not DCP metadata ({' '.join(str(err).split())[:120]})") \
            from None
    if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict):
        raise UserError(f"checkpoint {path}: {METADATA} is not DCP metadata")
    for info in md.storage_data.values():
        if getattr(info, "relative_path", None) not in listed or not DATA_FILE.match(info.relative_path):
            raise UserError(f"checkpoint {path}: {METADATA} names a data file the manifest does not list")
    return md


def _nofollow(file: str, flags: int) -> int:
    return os.open(file, flags | getattr(os, "O_NOFOLLOW", 0))


class _CheckedReader(dcp.FileSystemReader):
    """FileSystemReader that gets its metadata from `read_metadata` (checked; never plain pickle)."""

    def __init__(self, path: Path, manifest: dict):
        super().__init__(path)
        self._checked = read_metadata(path, manifest)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        md = self._checked
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


# -- loading ------------------------------------------------------------------------------------------

class _PieceLoadPlanner(DefaultLoadPlanner):
    """Asks DCP, for each key, for this rank's boxes (DCP's resharding: reads of every stored chunk
    that overlaps one), writes each read into its box's view, and checks every box is filled whole."""

    def __init__(self, wanted: Pieces, where: str):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.wanted, self.where = wanted, where
        self.views = {(k, b.offsets): b.view for k, (_, bs) in wanted.items() for b in bs}

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False):
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items = []
        for key, (full, bs) in self.wanted.items():
            md = self.metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise UserError(f"{self.where} does not match the model: it holds no {key}")
            if tuple(md.size) != tuple(full):
                raise UserError(f"{self.where} does not match the model: {key} has shape {tuple(md.size)} there, "
                                f"{tuple(full)} here")
            chunks = [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in bs]
            got = create_read_items_for_chunk_list(key, md, chunks)
            filled = sum(math.prod(r.lengths) for r in got)
            if filled != sum(math.prod(b.sizes) for b in bs):  # stored chunks that do not cover it: refuse
                raise UserError(f"{self.where}: the stored chunks of {key} do not cover this rank's piece")
            items += got
        self.plan = LoadPlan(items)
        return self.plan

    def resolve_tensor(self, read_item):
        view = self.views[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for d, (off, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            view = view.narrow(d, off, n)
        return view

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        from hybridpar.train.checkpoint import READ_BYTES

        READ_BYTES[0] += tensor.numel() * tensor.element_size()


def load_boxes(path: Path, manifest: dict, wanted: Pieces,
               reader: _CheckedReader | None = None) -> None:
    """Fill every box of `wanted` from checkpoint `path` (this process alone: no collective)."""
    where = f"checkpoint {path}"
    try:
        with warnings.catch_warnings():  # no_dist is meant: a rank reads its own pieces, no collective
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({}, storage_reader=reader or _CheckedReader(path, manifest),
                     planner=_PieceLoadPlanner(wanted, where), no_dist=True)
    except CheckpointException as err:
        inner = unwrap(err)
        if isinstance(inner, UserError):
            raise inner from None
        raise UserError(f"{where}: {type(inner).__name__}: {' '.join(str(inner).split())[:160]}") from None


def stored(md: Metadata, prefix: str) -> dict[str, TensorStorageMetadata]:
    """The tensors of `md` whose key starts with `prefix`, keyed by the rest of the key."""
    return {k[len(prefix):]: v for k, v in md.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}


def empty_like_stored(md: TensorStorageMetadata) -> torch.Tensor:
    return torch.empty(tuple(md.size), dtype=md.properties.dtype)


def full_model_state(path: Path, manifest: dict) -> dict[str, torch.Tensor]:
    """The undistributed model's state_dict stored in DCP checkpoint `path` (no process group)."""
    reader = _CheckedReader(path, manifest)
    md = reader.read_metadata()
    out = {name: empty_like_stored(m) for name, m in stored(md, "model.").items()}
    load_boxes(path, manifest, {model_key(n): (tuple(t.shape), boxes(t, None)) for n, t in out.items()}, reader)
    return out


def _target(t: torch.Tensor) -> torch.Tensor | None:
    """Where a read can land directly: the local tensor (a plain tensor, a replicated DTensor's or an
    FSDP shard's local rows); None for a DTensor that DTensor itself shards (read whole, then cut)."""
    from torch.distributed.tensor import DTensor

    from hybridpar.train.checkpoint_sharded import is_fsdp_shard

    if isinstance(t, DTensor) and not is_fsdp_shard(t) and not all(p.is_replicate() for p in t.placements):
        return None
    return _plain(t)


def load_pieces(path: Path, manifest: dict, engine) -> None:
    """A resume after make_engine: this rank's pieces of the weights and buffers, read by DCP from the
    stored chunks that overlap them (the same layout: its own chunks only)."""
    import torch.distributed as dist

    from hybridpar.train.checkpoint import _assign, _check_names, local_tensors

    where = f"checkpoint {path}"
    tensors, shards = local_tensors(engine)
    reader = _CheckedReader(path, manifest)
    md = reader.read_metadata()
    whole = stored(md, "model.")
    _check_names(whole, tensors, where)
    rank = dist.get_rank()
    same = manifest.get("world_size") == dist.get_world_size() and \
        (manifest.get("rank_pieces") or [None] * (rank + 1))[rank] == pieces_digest(tensors, shards)
    own = stored(md, replica_key(rank, "")) if same else {}  # this rank's own copies: the same pieces
    wanted: Pieces = {}
    later = []
    for name, t in tensors.items():
        key, target = model_key(name), _target(t)
        if name in own and target is not None:
            wanted[replica_key(rank, name)] = (tuple(target.shape), _boxes(target, None, where))
            continue
        if target is None:
            target = empty_like_stored(whole[name])
            later.append((name, t, target))
        info = shards.get(name)
        wanted[key] = (tuple(target.shape) if info is None else tuple(info.full_shape), _boxes(target, info, where))
    load_boxes(path, manifest, wanted, reader)
    for name, t, read in later:
        _assign(t, read, name, where)


def _boxes(local: torch.Tensor, info: ShardInfo | None, where: str) -> list[Box]:
    try:
        return boxes(local, info)
    except ValueError as err:
        raise UserError(f"{where} does not match the model: {err}") from None


def restore_training_state(path: Path, manifest: dict, engine, optimizer: torch.optim.Optimizer, *,
                           restore_rng: bool) -> None:
    """Optimizer slots (cut for this engine at its first step, a pre-step hook: engines may settle a
    piece's shape only at the first forward) and, under the same rank count, this rank's RNG state."""
    import torch.distributed as dist

    from hybridpar.train.checkpoint import _like, local_tensors

    where = f"checkpoint {path}"
    md = _CheckedReader(path, manifest).read_metadata()
    slots: dict[str, dict[str, TensorStorageMetadata]] = {}
    for key, m in stored(md, "optim.state.").items():
        name, _, slot = key.rpartition(".")
        slots.setdefault(name, {})[slot] = m
    numbers = set(manifest.get("python_scalars") or ())

    def apply(opt, _args, _kwargs) -> None:
        handle.remove()
        tensors, shards = local_tensors(engine)
        by_id = {id(t): n for n, t in tensors.items()}
        wanted: Pieces = {}
        got: list[tuple[torch.Tensor, str, str, torch.Tensor]] = []
        for p in (p for group in opt.param_groups for p in group["params"]):
            name = by_id.get(id(p))
            local, info = _target(p), shards.get(name or "")
            for slot, m in slots.get(name or "", {}).items():
                key = optim_key(name or "", slot)
                if len(m.size) == 0 or local is None:  # a count, or a DTensor-sharded parameter: whole
                    buf = empty_like_stored(m)
                    wanted[key] = (tuple(buf.shape), _boxes(buf, None, where))
                else:
                    buf = torch.empty(local.shape, dtype=m.properties.dtype)
                    full = tuple(local.shape) if info is None else tuple(info.full_shape)
                    wanted[key] = (full, _boxes(buf, info, where))
                got.append((p, slot, key, buf))
        load_boxes(path, manifest, wanted)
        for p, slot, key, buf in got:
            value = buf.item() if key in numbers else buf if buf.dim() == 0 else _like(p, buf)
            opt.state.setdefault(p, {})[slot] = value

    handle = optimizer.register_step_pre_hook(apply)
    if restore_rng and manifest.get("world_size") == dist.get_world_size():
        rng = md.state_dict_metadata.get(rng_key(dist.get_rank()))
        if isinstance(rng, TensorStorageMetadata):
            buf = empty_like_stored(rng)
            load_boxes(path, manifest, {rng_key(dist.get_rank()): (tuple(buf.shape), boxes(buf, None))})
            torch.set_rng_state(buf)
