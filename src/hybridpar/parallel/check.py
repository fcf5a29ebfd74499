"""The dry run: the parallelized model's forward and backward on meta tensors, on a fake process
group of the layout's world size, in this process, before any rank starts.

It finds every op the layout cannot serve (raised as a UserError naming the op and the module, so
`hybridpar train` exits 2 with one line and spawns nothing) and records every collective one step
issues on rank 0 of the layout: our layers' (as CommLog does at run time) and DTensor's own
redistributions, between them and inside its ops (a norm's split input gathered), with the module
each ran in, for the planner to price.
It needs a process with no process group yet (the launcher, the planner, a test's parent process).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, _redistribute
from torch.utils._pytree import tree_flatten, tree_map_only

from hybridpar.errors import UserError
from hybridpar.parallel.apply import INPUT_MODES, apply_layout, as_layouts, grid_shape, state_of
from hybridpar.parallel.comm.collectives import all_reduce_
from hybridpar.parallel.dtensor.log import counting_redistributions, recording
from hybridpar.parallel.mesh import forget_meshes
from hybridpar.parallel.sample_io import split_samples


@dataclass(frozen=True)
class DryRun:
    strategy: str
    world_size: int
    our_bytes: dict[str, int]  # per kind, our layers' collectives (rank 0)
    dtensor: list[dict] = field(default_factory=list)  # DTensor's: module, kind, group_size, bytes
    output_shapes: list[tuple[int, ...]] = field(default_factory=list)
    # DTensor's redistributions in one step on rank 0, with or without a message (each one's Python
    # is priced per call: hybridpar.api.with_redistributions)
    redistributions: int = 0

    @property
    def dtensor_bytes(self) -> dict[str, int]:
        """DTensor's moves the planner does not price (a record marked 'priced' is in our_bytes)."""
        out: dict[str, int] = {}
        for r in self.dtensor:
            if r["group_size"] > 1 and not r.get("priced"):
                out[r["kind"]] = out.get(r["kind"], 0) + r["bytes"]
        return dict(sorted(out.items()))

    @property
    def total_bytes(self) -> dict[str, int]:
        out = dict(self.our_bytes)
        for k, v in self.dtensor_bytes.items():
            out[k] = out.get(k, 0) + v
        return dict(sorted(out.items()))


def _meta(tree):
    return tree_map_only(torch.Tensor, lambda t: t.to("meta"), tree)


def default_loss(out, y):
    if out.dim() > 2 and y.dim() == out.dim() - 1:
        out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
    return F.cross_entropy(out, y)


# The meta run cannot follow a forward that reads tensor values in Python (HF GPT-2's masks check
# `(mask == 0).all()`): meta tensors have none. Such a model is run again with values, on CPU copies,
# when it is small enough for that to take seconds; a larger one is refused with the reason.
_DATA_DEPENDENT = ("cannot be called on meta tensors", "Cannot copy out of meta tensor", "_local_scalar_dense",
                   "data-dependent", "data dependent")
VALUES_RUN_MAX_PARAMS = 50_000_000


class _NeedsValues(Exception):
    """The meta run met a forward that reads tensor values; args: the refusal's text."""


def dry_run(module: nn.Module, spec, example_inputs, targets=None, *, world_size: int,
            loss_fn=default_loss, train: bool = True, inputs: str = "sample_shard", values=None) -> DryRun:
    """Run `module` (not modified: a meta copy is used) under `spec` (strategy string, LayerLayout or
    Plan) on `world_size` fake ranks. `example_inputs`: a tensor or tuple, the global batch.
    `targets`: labels for `loss_fn`; without them the backward starts from the sum of the outputs.
    It runs as the last rank first (the one holding torch.chunk's short or empty pieces, where an op
    that cannot take an empty input fails on that rank alone), then as rank 0, whose record it returns.
    `inputs`: "sample_shard" (as `hybridpar train` runs: each sample group its own rows, a per-group
    mean loss) or "global" (the API's default: the whole batch in, whole outputs on every rank).
    `values`: for a forward that reads tensor values, which meta tensors cannot follow, a function
    giving (module with its weights, inputs, targets), the same shapes with values; the run is then
    repeated on CPU copies of them (fake collectives: a value after one is not the real run's).
    Without it, `module` and the inputs are used as they are, if they have values."""
    def both(mod: nn.Module, batch, tgt, real: bool) -> DryRun:
        args = (mod, spec, batch, tgt, world_size)
        if world_size > 1:
            _one_rank(*args, world_size - 1, loss_fn, train, inputs, real)
        return _one_rank(*args, 0, loss_fn, train, inputs, real)

    try:
        return both(module, example_inputs, targets, False)
    except _NeedsValues as need:
        reason = str(need)
        real = _values_run(module, example_inputs, targets, values)
        if isinstance(real, str):
            raise UserError(f"{reason}; {real}") from None
        mod, batch, tgt = real
        return both(mod, batch, tgt, True)


def _values_run(module: nn.Module, example_inputs, targets, values):
    """(module, inputs, targets) to repeat the dry run with, or why it cannot be."""
    module, batch, tgt = values() if values is not None else (module, example_inputs, targets)
    tensors = [*module.parameters(), *module.buffers()]
    if any(t.device.type != "cpu" for t in tensors):
        return "the check runs such a model with values only when its weights are on the CPU"
    n = sum(p.numel() for p in module.parameters())
    if n > VALUES_RUN_MAX_PARAMS:
        return (f"the check runs such a model with values only up to {VALUES_RUN_MAX_PARAMS:,} parameters "
                f"(this one has {n:,}); use a sample-only layout for this model")
    if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tree_flatten((batch, tgt))[0]):
        return "there are no example inputs with values on the CPU to run it on"
    return module, batch, tgt


def _one_rank(module, spec, example_inputs, targets, world_size: int, rank: int, loss_fn, train: bool,
              inputs: str, real: bool = False) -> DryRun:
    batch = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    model = copy.deepcopy(module) if real else _meta_copy(module)
    place = (lambda tree: tree) if real else _meta
    model.train(train)
    with fake_world(world_size, rank):
        grid = state_of(apply_layout(model, spec, inputs=inputs)).grid
        if inputs == "sample_shard":
            batch, targets = split_samples(batch, grid), split_samples(targets, grid)
        log = grid.comm_log
        log.mark_step()
        with recording(log) as rec, counting_redistributions() as moves:
            try:
                out = model(*place(batch))
                outs = output_tensors(out)
                floats = [o for o in outs if o.is_floating_point() and o.requires_grad]
                if not floats:
                    raise UserError(_no_output(out))
                loss: torch.Tensor = (loss_fn(floats[0], place(targets)) if targets is not None
                                      else torch.stack([o.float().sum() for o in floats]).sum())
                loss.backward()
                if inputs == "sample_shard" and grid.sample > 1:  # hybridpar train reports the global loss
                    all_reduce_(loss.detach().reshape(1), grid.replica_group, log, "loss")
            except UserError:
                raise
            except Exception as err:  # noqa: BLE001 - every failure becomes one line naming op and module
                where = module_path(rec.tracker.parents)
                if not real and any(k in str(err) for k in _DATA_DEPENDENT):
                    raise _NeedsValues(f"{_strategy_text(spec)}: the forward of module '{where}' reads tensor "
                                       f"values ({' '.join(str(err).split())[:120]}), which a check on meta "
                                       "tensors cannot follow") from None
                raise UserError(_refusal(err, where, spec)) from None
        records = [{**r, "module": module_path({r["module"]})} for r in rec.records]
        ours = log.step_bytes_by_kind()
        for r in records:  # the recorder logged DTensor's collectives too: keep ours (and priced ones) apart
            if r["group_size"] > 1 and not r.get("priced"):
                ours[r["kind"]] -= r["bytes"]
        return DryRun(_strategy_text(spec), world_size, {k: v for k, v in ours.items() if v},
                      records, [tuple(o.shape) for o in outs], moves.calls)


@contextmanager
def fake_world(world_size: int, rank: int = 0):
    """This process as `rank` of a world of `world_size` on PyTorch's fake process group (collectives
    are no-ops; everything else runs), with DTensor's caches and our meshes fresh on entry and exit.
    The process must not hold a process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's test utilities: on use

    if dist.is_initialized():
        raise RuntimeError("a fake world needs a process without a process group (run it before launching ranks)")
    _clear_dtensor_caches()
    hook = sys.excepthook  # init_process_group wraps it with a "[rank<r>]:" prefix: not this process's rank
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    sys.excepthook = hook
    try:
        yield
    finally:
        forget_meshes()
        dist.destroy_process_group()
        _clear_dtensor_caches()


def output_tensors(out) -> list[torch.Tensor]:
    """Every tensor in a forward's output, in order, whatever holds them: tuples, lists, dicts,
    dataclasses (HF ModelOutput is both a dict and a dataclass: its dict view holds the fields that are
    set), nested. Anything else (None, a cache object, a number) holds no tensor for the backward."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        items = list(out.values())
    elif isinstance(out, (tuple, list)):
        items = list(out)
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        items = [getattr(out, f.name) for f in dataclasses.fields(out)]
    else:
        return []
    return [t for item in items for t in output_tensors(item)]


def _no_output(out) -> str:
    return (f"the model's output ({type(out).__name__}) holds no floating-point tensor that requires grad, "
            "so there is no backward to check; return the logits (a tensor, or in a tuple, dict or dataclass)")


def _clear_dtensor_caches() -> None:
    """DTensor memoises redistribution plans and sharding decisions keyed by specs whose mesh hashes
    equal across our simulated worlds, but some hold one rank's coordinates: start each rank fresh."""
    for fn in (getattr(_redistribute, "_gen_transform_infos", None),
               getattr(DTensor._op_dispatcher.sharding_propagator, "_propagate_tensor_meta_cached", None)):
        clear = getattr(fn, "cache_clear", None)
        if clear is not None:
            clear()
    cached = getattr(DTensor._op_dispatcher.sharding_propagator, "propagate_op_sharding", None)
    clear = getattr(getattr(cached, "cache", None), "cache_clear", None)
    if clear is not None:
        clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's
    if clear_native is not None:
        clear_native()


def _strategy_text(spec) -> str:
    if isinstance(spec, str):
        return spec
    lay = getattr(spec, "default_layout", spec)
    return lay.to_strategy()


def module_path(parents) -> str:
    """ModuleTracker's innermost module ("Net.layer1.conv" -> "layer1.conv"; the root -> "<model>")."""
    names = [p for p in parents if p != "Global"]
    if not names:
        return "<model>"
    inner = max(names, key=lambda n: n.count("."))
    return inner.partition(".")[2] or "<model>"


def _refusal(err: BaseException, where: str, spec) -> str:
    text = " ".join(str(err).split())
    m = re.search(r"aten\.[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)?", text)
    what = f"op {m.group(0)}" if m else type(err).__name__
    return (f"{_strategy_text(spec)}: {what} in module '{where or '<model>'}' cannot run with this layout "
            f"({text[:160]}); use a sample-only layout for this model")


def check(module: nn.Module, spec, example_inputs, targets=None, *, world_size: int | None = None,
          inputs: str = "global", loss_fn=default_loss) -> DryRun:
    """The dry run as a user's own pre-start check (`hybridpar.check`, `parallelize(check_inputs=)`):
    raises a UserError naming the op and the module the layout cannot serve, else returns the
    DryRun. Runs on this process alone (no collective), so every rank of a world can call it with
    the same arguments and all of them refuse the same way before any real collective.

    `example_inputs`: what the user passes to model(...) (a tensor or tuple; any device, only shapes
    and dtypes are used): the global batch, or with inputs="sample_shard" this rank's samples.
    `world_size`: the layout's ranks (default: the current world's). With a process group already
    initialised (under torchrun), the fake world runs in a forked child, since torch.distributed
    holds one default group per process and its registries are process-wide."""
    if inputs not in INPUT_MODES:
        raise UserError(f"inputs must be one of {', '.join(INPUT_MODES)}, got {inputs!r}")
    live = dist.is_available() and dist.is_initialized()
    if world_size is None:
        if not live:
            raise UserError("check: give world_size (there is no process group to take it from)")
        world_size = dist.get_world_size()
    given = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    s = grid_shape(as_layouts(spec, world_size))[0] if inputs == "sample_shard" else 1

    def whole(t, device=None):  # the dry run takes the global batch and splits it as the ranks do
        if not (isinstance(t, torch.Tensor) and t.dim()) or s == 1:
            return t.to("meta") if device == "meta" and isinstance(t, torch.Tensor) else t
        if device == "meta":
            return t.new_empty((t.shape[0] * s, *t.shape[1:]), device="meta")
        return torch.cat([t] * s)

    batch, meta_targets = tuple(whole(t, "meta") for t in given), whole(targets, "meta")
    # the meta copy is made here, before any fork: a forked child must not touch a CUDA tensor
    args = (_meta_copy(module), spec, batch, meta_targets)
    kwargs = {"world_size": world_size, "loss_fn": loss_fn, "train": module.training, "inputs": inputs,
              "values": lambda: (module, tuple(whole(t) for t in given), whole(targets))}
    if not live:
        return dry_run(*args, **kwargs)
    return _in_child(dry_run, args, kwargs)


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` whose parameters and buffers are on the meta device, made without
    allocating a real copy (deepcopy with each tensor pre-mapped to its meta twin)."""
    memo: dict[int, object] = {}
    for t in (*module.parameters(), *module.buffers()):
        meta = t.detach().to("meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _in_child(fn, args, kwargs):
    """fn(*args, **kwargs) in a forked child that forgets this process's process groups (it builds
    its own fake world; nothing it registers reaches this process); its result or its UserError
    comes back through a pipe. The child touches no device: its tensors are on the meta device (or
    CPU copies, for a forward that reads values: see dry_run)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.close(read)
            _forget_process_groups()
            try:
                res = ("ok", fn(*args, **kwargs))
            except UserError as err:
                res = ("user", str(err))
            except BaseException as err:  # noqa: BLE001 - reported in the parent
                res = ("error", f"{type(err).__name__}: {err}")
            with os.fdopen(write, "wb") as f:
                f.write(pickle.dumps(res))
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    if not data:
        raise RuntimeError("hybridpar check: the dry run's child process died without a result")
    kind, value = pickle.loads(data)
    if kind == "user":
        raise UserError(value)
    if kind == "error":
        raise RuntimeError(f"hybridpar check: the dry run failed: {value}")
    return value


_PARENT_GROUPS: list = []  # in a forked child: the parent's process-group state, never released


def _forget_process_groups() -> None:
    """In a forked child: a fresh torch.distributed world state (no default group), so the dry run's
    fake world can be initialised. The parent's groups stay as they were in the parent."""
    names = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_tags_to_pg", "_pg_to_tag")
    # Kept alive: a real group destroyed in the child waits forever for its threads, which fork left behind.
    _PARENT_GROUPS.append((c10d._world, [getattr(c10d, n) for n in names]))
    for name in names:
        setattr(c10d, name, {})  # _World's properties read these module globals
    c10d._world = c10d._World()
    c10d._world.group_count = 0
    unregister = getattr(torch._C._distributed_c10d, "_unregister_all_process_groups", None)
    if unregister is not None:  # the name -> group registry functional collectives resolve through
        unregister()
    forget_meshes()
