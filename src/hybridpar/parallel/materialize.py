"""Each rank builds only its own pieces of the model, bit-identical to the model built whole (issue 17).

The model's factory runs twice. First on the meta device under `Recorder`, a TorchDispatchMode that
writes down every aten op (name, output shapes) and which storages it reads and writes; parallelize
then cuts the meta model as usual (the styles slice meta weights; `shard_fns` say which ranges of the
undistributed tensor each local tensor holds). Second, for real on CPU with the same seed, under
`Replayer`, which checks every op against the record and, right after the last op that touches a
parameter's or buffer's storage, copies this rank's piece of it into the parallel model and frees the
storage (`untyped_storage().resize_(0)`, as FSDP frees parameters). A storage whose next access
overwrites it whole without reading it (normal_, uniform_, fill_, zero_, copy_, ...) is freed in
between and given back just before that op, so init loops at the end of a factory (torchvision's
ResNet re-initialises every conv there) still hold one layer at a time; a weight whose last write is
`uniform_` over all of it (Conv/Linear's default init) is drawn by blocks of rows straight into the
rank's piece (`ROWS_BYTES`), never whole. Peak at start-up: the rank's pieces plus at most one whole
tensor of another kind (or one block). The same ops in the same order draw the same random numbers, so
every piece equals the same range of the model built whole in one process with that seed.

A factory the replay cannot follow (it branches on the device, reads values on meta, keeps tensors
outside parameters and buffers) is detected: the op stream differs from the record, or a meta tensor
is left over. Then the rank builds the whole model and cuts its pieces from it, and says so on stderr.

Why by hand: torch's deferred init (torchdistx) is unmaintained for torch 2.x, `to_empty` +
`reset_parameters` gives other values than the factory (another order of random draws, and a user's
own init code is lost), and fake tensors carry no values.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hybridpar.parallel.state import ShardInfo, take

# In-place ops whose written tensor's old values are not read (a later one makes earlier writes dead).
# torch.tensor(data) makes its tensor outside the dispatcher and hands it on through lift_fresh on CPU
# only (on meta the dispatcher sees nothing): both runs skip it.
_UNSEEN = frozenset({"lift_fresh", "lift_fresh_copy", "lift"})
_PURE_WRITES = frozenset({"normal_", "uniform_", "fill_", "zero_", "random_", "exponential_", "geometric_",
                          "log_normal_", "cauchy_", "copy_", "bernoulli_"})


class ReplayDiverged(RuntimeError):
    """The real build did not run the ops the meta build recorded."""


def _op_name(func) -> str:
    return func._schema.name.split("::")[-1]


def _tensors(v) -> list[torch.Tensor]:
    return [t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return None


def _whole(t: torch.Tensor, st) -> bool:
    """Whether `t` covers all of its storage (an overwrite of it leaves nothing of the old bytes)."""
    return t.storage_offset() == 0 and t.is_contiguous() and t.numel() * t.element_size() == st.nbytes()


class _Storages:
    """Storage identities in order of first sight (sid 0, 1, ...): equal programs number their storages
    alike on meta and on CPU. The weak references held here keep each StorageImpl's address taken (its
    bytes are freed as usual), so an address is never a second storage's."""

    def __init__(self):
        self.by_cdata: dict[int, tuple[int, StorageWeakRef]] = {}
        self.refs: dict[int, StorageWeakRef] = {}
        self.count = 0

    def known(self, st) -> int | None:
        """The storage's id if it has one (a storage some op touched), else None."""
        ref = StorageWeakRef(st)
        got = self.by_cdata.get(ref.cdata)
        return got[0] if got is not None and not got[1].expired() else None

    def sid(self, st) -> int:
        """The storage's id, a new one for a storage not seen before."""
        old = self.known(st)
        if old is not None:
            return old
        ref = StorageWeakRef(st)
        sid, self.count = self.count, self.count + 1
        self.by_cdata[ref.cdata] = (sid, ref)
        return sid


def _accesses(func, args, kwargs, out, storages: _Storages) -> list[tuple[int, str]]:
    """(sid, kind) of every storage the op touches: "r" read, "w" overwritten whole without reading,
    "rw" written and read. View ops (inputs aliased, not written) touch nothing."""
    found: dict[int, str] = {}

    def note(sid: int, kind: str) -> None:
        old = found.get(sid)
        found[sid] = kind if old is None or old == kind else "rw"

    pure = _op_name(func) in _PURE_WRITES
    for i, a in enumerate(func._schema.arguments):
        v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        alias = a.alias_info
        for t in _tensors(v):
            st = _storage(t)
            if st is None:
                continue
            sid = storages.sid(st)
            if alias is not None and alias.is_write:
                note(sid, "w" if pure and _whole(t, st) else "rw")
            elif alias is None:
                note(sid, "r")
    for t in _tensors(out):
        st = _storage(t)
        if st is not None and storages.known(st) is None:
            note(storages.sid(st), "w")  # a new storage: the op made it
    return sorted(found.items())


def _shapes(out) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in _tensors(out))


@dataclass
class Record:
    """What the meta build did: per op its name and outputs' shapes, and the storages it touched; and
    where each parameter and buffer of the built model lives (sid, dtype, size, stride, offset, bytes)."""

    ops: list[tuple[str, tuple]] = field(default_factory=list)
    touches: list[list[tuple[int, str]]] = field(default_factory=list)
    tensors: dict[str, tuple[int | None, torch.dtype, tuple, tuple, int]] = field(default_factory=dict)
    nbytes: dict[int, int] = field(default_factory=dict)


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.record = Record()
        self.storages = _Storages()
        self.probes = _MetaHiddenFromProbes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.probes.todo:
            self.probes.check()
        out = func(*args, **kwargs)
        if _op_name(func) in _UNSEEN:
            return out
        touched = _accesses(func, args, kwargs, out, self.storages)
        for t in _tensors(out):
            st = _storage(t)
            if st is not None:
                self.record.nbytes[self.storages.sid(st)] = st.nbytes()
        self.record.ops.append((_op_name(func), _shapes(out)))
        self.record.touches.append(touched)
        return out

    def finish(self, module: nn.Module) -> Record:
        for name, t in _named_tensors(module):
            st = _storage(t)
            # None: no op touched it (torch.tensor(data) and nothing else); copied once the build returns
            sid = self.storages.known(st) if st is not None else None
            self.record.tensors[name] = (sid, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())
        return self.record


def _named_tensors(module: nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from ((n, b) for n, b in module.named_buffers(remove_duplicate=False) if b is not None)


class Replayer(TorchDispatchMode):
    """Runs the factory for real, checks it against `record`, and hands each parameter's or buffer's
    storage to `fill(sid, storage)` after the last op that touches it, then frees it."""

    def __init__(self, record: Record, fill: Callable[[int, torch.UntypedStorage], None],
                 fill_rows: Callable[[int, Callable], None] | None = None, chunkable: frozenset = frozenset()):
        super().__init__()
        self.record, self.fill, self.fill_rows = record, fill, fill_rows
        self.storages = _Storages()
        self.i = 0
        self.live: dict[int, torch.UntypedStorage] = {}
        finals = {v[0] for v in record.tensors.values() if v[0] is not None}
        seen: dict[int, list[tuple[int, str]]] = {}
        for i, touched in enumerate(record.touches):
            for sid, kind in touched:
                if sid in finals:
                    seen.setdefault(sid, []).append((i, kind))
        self.done_after: dict[int, list[int]] = {}  # op -> sids whose last access it is
        self.park_after: dict[int, list[int]] = {}  # op -> sids dead until their next (whole) overwrite
        self.unpark_before: dict[int, list[int]] = {}
        for sid, acc in seen.items():
            self.done_after.setdefault(acc[-1][0], []).append(sid)
            for (i, _), (j, kind) in zip(acc, acc[1:]):
                if kind == "w" and j > i:
                    self.park_after.setdefault(i, []).append(sid)
                    self.unpark_before.setdefault(j, []).append(sid)
        self.filled: set[int] = set()
        # a weight whose last write is uniform_ over all of it, its old bytes dead (parked): generated a
        # block of rows at a time (the CPU generator draws one number per element in order, so the
        # blocks are the same numbers; tests compare with the whole build), never held whole
        self.by_rows: dict[int, int] = {}
        for sid, acc in seen.items():
            i, kind = acc[-1]
            if (fill_rows is not None and sid in chunkable and kind == "w" and len(acc) > 1
                    and record.ops[i][0] == "uniform_"):
                self.by_rows[i] = sid

    def _diverged(self, what: str) -> ReplayDiverged:
        return ReplayDiverged(f"op {self.i}: {what}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _op_name(func) in _UNSEEN:
            return func(*args, **kwargs)
        i = self.i
        if i >= len(self.record.ops):
            raise self._diverged(f"{_op_name(func)} after the {len(self.record.ops)} ops recorded on meta")
        rows_sid = self.by_rows.get(i)
        if rows_sid is not None and (len(args) > 3 or kwargs.get("generator") is not None
                                     or args[0].dtype != torch.float32):
            rows_sid = None  # a generator of its own, or another dtype: not known to draw alike
        for sid in self.unpark_before.get(i, ()):
            if sid != rows_sid:
                self.live[sid].resize_(self.record.nbytes[sid])
        for t in _tensors((args, kwargs)) if rows_sid is None else ():  # a parked (freed) weight, unexpected:
            st = _storage(t) if t.numel() else None  # the kernel would write through a null pointer (segfault)
            if st is not None and st.nbytes() == 0 and t.device.type != "meta":
                raise self._diverged(f"{_op_name(func)} touches a weight the meta record had finished with")
        if rows_sid is not None:
            out = args[0]
            assert self.fill_rows is not None  # by_rows is empty without it
            self.fill_rows(rows_sid, lambda shape: func(torch.empty(shape, dtype=out.dtype), *args[1:], **kwargs))
            self.filled.add(rows_sid)
        else:
            out = func(*args, **kwargs)
        name, shapes = self.record.ops[i]
        got = (_op_name(func), _shapes(out))
        if got != (name, shapes):
            raise self._diverged(f"expected {name} {_fmt(shapes)}, got {got[0]} {_fmt(got[1])}")
        touched = _accesses(func, args, kwargs, out, self.storages)
        if [s for s, _ in touched] != [s for s, _ in self.record.touches[i]]:
            raise self._diverged(f"{name} touched other storages than on meta")
        for t in _tensors(out):
            st = _storage(t)
            if st is not None:
                self.live.setdefault(self.storages.sid(st), st)
        for sid in self.done_after.get(i, ()):
            if sid not in self.filled:
                self.fill(sid, self.live[sid])
                self.filled.add(sid)
            self.live.pop(sid).resize_(0)
        for sid in self.park_after.get(i, ()):
            if sid not in self.filled:
                self.live[sid].resize_(0)
        self.i += 1
        return out

    def check_done(self) -> None:
        if self.i != len(self.record.ops):
            raise ReplayDiverged(f"the real build ran {self.i} ops, the meta build {len(self.record.ops)}")


def _fmt(shapes) -> str:
    return "[" + ", ".join(f"{list(s)} {str(d).removeprefix('torch.')}" for s, d in shapes) + "]"


def stray_meta_tensors(module: nn.Module) -> list[str]:
    """Tensors on meta that are neither parameters nor buffers (plain attributes): the replay cannot
    give them values."""
    out = []
    for mname, m in module.named_modules():
        for k, v in vars(m).items():
            if isinstance(v, torch.Tensor) and v.device.type == "meta" and not k.startswith("_"):
                out.append(f"{mname}.{k}" if mname else k)
    return out


@dataclass
class Materializer:
    """parallelize's `materialize` hook: gives the parallel module (cut on meta) this rank's pieces.

    `build()` is the factory: it returns the undistributed module (e.g. a LoadedModel's module) and
    is called with the global RNG seeded by `seed`, as the serial build is; `record` its meta run."""

    build: Callable[[], nn.Module]
    record: Record | None
    seed: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    notes: list[str] = field(default_factory=list)
    last_build: object = None  # what build() returned in the real run (example inputs and all)

    def __call__(self, module: nn.Module, state) -> None:
        shards = state.shards() if state is not None else {}
        module.to_empty(device=self.device)
        targets = dict(_named_tensors(module))
        stray = stray_meta_tensors(module)
        if stray:
            raise ReplayDiverged(f"{stray[0]} is a tensor outside the parameters and buffers")
        try:
            if self.record is None:
                raise ReplayDiverged("the model could not be built on the meta device")
            self._replay(targets, shards)
        except ReplayDiverged as err:
            self._whole(targets, shards, str(err))

    def build_freed(self):
        """Run the factory for real with every parameter and buffer freed after its last use: what it
        returns (example inputs, the module's structure) without its weights, about one layer held at
        a time. ReplayDiverged when the factory does not follow the record."""
        self._replay({}, {})
        return self.last_build

    def _replay(self, targets: dict, shards: dict) -> None:
        rec = self.record
        assert rec is not None  # __call__ refuses a missing record first
        missing = [n for n in targets if n not in rec.tensors]
        if missing:
            raise ReplayDiverged(f"{missing[0]} of the parallel model is not in the model")
        by_sid: dict[int | None, list[str]] = {}
        for n in targets:
            by_sid.setdefault(rec.tensors[n][0], []).append(n)

        def fill(sid: int, st: torch.UntypedStorage) -> None:
            for n in by_sid.get(sid, ()):
                _, dtype, size, stride, off = rec.tensors[n]
                full = torch.empty(0, dtype=dtype).set_(st, off, size, stride)
                _copy_piece(targets[n], full, shards.get(n), n)

        every: dict[int | None, list[str]] = {}  # the model's tensors by storage (build_freed keeps none)
        for n, v in rec.tensors.items():
            every.setdefault(v[0], []).append(n)

        def fill_rows(sid: int, make: Callable) -> None:
            names = by_sid.get(sid, [])
            size = rec.tensors[every[sid][0]][2]
            blocks = math.ceil(4 * math.prod(size) / ROWS_BYTES)  # even blocks: none small, left in the heap
            step = max(1, math.ceil(size[0] / max(1, blocks)))
            for r0 in range(0, size[0], step):
                block = make((min(step, size[0] - r0), *size[1:]))
                for n in names:
                    _copy_rows(targets[n], block, r0, shards.get(n), size)

        chunkable = frozenset(sid for sid, names in every.items() if sid is not None
                              and all(_whole_view(rec, n) for n in names))
        torch.manual_seed(self.seed)
        mode = Replayer(rec, fill, fill_rows, chunkable)
        with mode:
            try:
                self.last_build = self.build()
            except ReplayDiverged:
                raise
            except Exception as err:  # ran on meta, fails replayed (HF's second init of a freed weight)
                raise ReplayDiverged(f"the factory failed when replayed: {' '.join(str(err).split())[:160]}") \
                    from None
        mode.check_done()
        late = by_sid.get(None, [])  # tensors no op touched: small constants, copied from the built model
        if late:
            built = dict(_named_tensors(_module_of(self.last_build)))
            for n in late:
                _copy_piece(targets[n], built[n].detach(), shards.get(n), n)
        unfilled = [n for n in targets if rec.tensors[n][0] is not None and rec.tensors[n][0] not in mode.filled]
        if unfilled:
            raise ReplayDiverged(f"{unfilled[0]} was not filled by the replay")

    def _whole(self, targets: dict, shards: dict, why: str) -> None:
        import torch.distributed as dist

        msg = (f"hybridpar: cannot build only this rank's pieces of the model ({why}); building it whole "
               "on every rank (start-up memory: the whole model per rank)")
        self.notes.append(msg)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(msg, file=sys.stderr, flush=True)
        torch.manual_seed(self.seed)
        self.last_build = self.build()
        whole = dict(_named_tensors(_module_of(self.last_build)))
        for n, t in targets.items():
            if n not in whole:
                raise ReplayDiverged(f"{n} of the parallel model is not in the model")
            _copy_piece(t, whole[n].detach(), shards.get(n), n)


# A weight generated by blocks of rows holds about this much at a time: above glibc's largest mmap
# threshold (32 MiB), so each block is mapped and unmapped (heap blocks stayed resident: +128 MiB per
# resnet50_w8 layer measured with 32 MiB blocks). Tensors this small or smaller are drawn whole.
ROWS_BYTES = 96 * 2**20  # blocks of 48-96 MiB


def _whole_view(rec: Record, name: str) -> bool:
    """The tensor is its storage, contiguous from offset 0 (a block of rows is a block of the storage)."""
    sid, dtype, size, stride, off = rec.tensors[name]
    contiguous = tuple(torch.empty(size, device="meta").stride()) == tuple(stride)
    return (sid is not None and off == 0 and contiguous and len(size) > 0 and dtype == torch.float32
            and math.prod(size) * 4 == rec.nbytes.get(sid, -1))


def _copy_rows(target: torch.Tensor, block: torch.Tensor, r0: int, info: ShardInfo | None, size) -> None:
    """Copy rows r0.. of the full tensor (`block`) into their places in this rank's piece `target`."""
    n = block.shape[0]
    row_ranges = info.dims[0] if info is not None and info.dims and info.dims[0] is not None else ((0, size[0]),)
    rest = ShardInfo(tuple(size), (None, *info.dims[1:])) if info is not None else None
    at = 0  # where each range of rows starts in the piece
    for off, cnt in row_ranges:
        lo, hi = max(off, r0), min(off + cnt, r0 + n)
        if lo < hi:
            with torch.no_grad():
                target.narrow(0, at + lo - off, hi - lo).copy_(take(block[lo - r0:hi - r0], rest))
        at += cnt


def _module_of(built) -> nn.Module:
    return built if isinstance(built, nn.Module) else built.module


def _copy_piece(target: torch.Tensor, full: torch.Tensor, info: ShardInfo | None, name: str) -> None:
    piece = take(full, info)
    if tuple(piece.shape) != tuple(target.shape):
        raise ReplayDiverged(f"{name}: piece {tuple(piece.shape)} for a local tensor of {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(piece)


# Libraries that skip their weight init when they see a meta-device context: the record must hold the
# init the real build runs, so while recording, their probe answers "no device context" (the replay still
# checks every op against the record, so a library that then branches otherwise falls back as usual).
# transformers' PreTrainedModel.init_weights skips initialize_weights on meta (modeling_utils, 5.x).
_DEVICE_PROBES = (("transformers.modeling_utils", "get_torch_context_manager_or_global_device"),)


class _MetaHiddenFromProbes:
    """Patches each probe once its library is imported: a factory file imports it inside the build,
    before the model's first op, so checking at every recorded op catches it before the probe runs."""

    def __init__(self):
        self.patched: list[tuple[object, str, object]] = []
        self.todo = list(_DEVICE_PROBES)

    def check(self) -> None:
        for item in list(self.todo):
            mod = sys.modules.get(item[0])
            if mod is not None and callable(getattr(mod, item[1], None)):
                self.patched.append((mod, item[1], getattr(mod, item[1])))
                setattr(mod, item[1], lambda: None)
                self.todo.remove(item)

    def restore(self) -> None:
        for mod, attr, fn in self.patched:
            setattr(mod, attr, fn)


def record_build(build: Callable[[], object]) -> tuple[object, Record | None, str | None]:
    """Run `build()` on the meta device under the Recorder, the RNG untouched. Returns what it built
    (on meta), the record, and None; or (None, None, why) when it cannot run on meta."""
    rec = Recorder()
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"), rec:
            built = build()
        return built, rec.finish(_module_of(built)), None
    except ReplayDiverged as err:
        return None, None, str(err)
    except (Exception, SystemExit) as err:  # noqa: BLE001 - a user's factory can fail on meta in any way
        # (.item(), numpy, sys.exit): the whole build then says what it is, as it always has
        return None, None, f"on meta: {type(err).__name__}: {' '.join(str(err).split())[:160]}"
    finally:
        rec.probes.restore()
