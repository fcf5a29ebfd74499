"""The sample dimension's parameters sharded (FSDP2, `zero=2|3`) and activation recomputation
(`recompute="all"`), applied by `parallelize` after the layout (hybridpar.parallel.apply).

Sharding: a sample-only layout with `zero=3` (ZeRO-3: parameters gathered for a block's forward,
freed, gathered again for its backward) or `zero=2` (gathered once, kept until the block's backward
is done: FSDP2 `reshard_after_forward=False`) first runs apply_layout's sample-only path as it is
(each rank takes its sample group's rows of the global batch, batch norm with global statistics, the
outputs gathered back), then hands gradient synchronisation to FSDP2: `fully_shard` on every block
(`blocks`) and on the root, over a 1-D DeviceMesh of the sample ranks. The convention stays
apply_layout's: under inputs="global" a rank's gradient is its rows' share of the global loss's and
the reduce-scatter sums them (divide factor 1); under inputs="sample_shard" it averages them (DDP's).

Recomputation: each block's forward runs under torch.utils.checkpoint (non-reentrant, RNG state
preserved), so only block inputs are kept from forward to backward. A recomputed forward restores
the block's buffers when it is done, so batch-norm running statistics (and any other buffer a forward
updates) change once per step, as in one process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from hybridpar.errors import UserError
from hybridpar.plans import LayerLayout, Plan, parse_strategy

RECOMPUTE = ("none", "all")

__all__ = ["RECOMPUTE", "blocks", "finish", "recompute_blocks", "sharding_refusal", "take_options"]


def sharding_refusal(layouts: list[LayerLayout], mp: int, recompute: str) -> str | None:
    """Why `zero` / `recompute` cannot run with these layouts yet (None: they can). Pure: before any rank
    starts (hybridpar train's checks) and before parallelize's first collective."""
    if recompute not in RECOMPUTE:
        return f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}"
    zeros = {lay.zero for lay in layouts}
    zeroed = next((lay for lay in layouts if lay.zero), None)
    if zeroed is not None:
        why = zeroed.zero_refusal()
        if why is not None:
            return why
        if mp > 1:
            return f"zero={zeroed.zero} does not run with model parallelism (mp > 1) yet"
        if len(zeros) > 1 or any(lay != layouts[0] for lay in layouts):
            return (f"zero={zeroed.zero}: a plan whose layers differ in their layout or zero level does not "
                    "run yet; give every layer the same sample-only layout")
    if recompute != "none":
        if mp > 1:
            return f"recompute={recompute} does not run with model parallelism (mp > 1) yet"
        split = next((lay for lay in layouts if lay.g_size > 1 or lay.spatial > 1), None)
        if split is not None:
            return (f"recompute={recompute} runs with sample-only layouts for now, not with "
                    f"{split.to_strategy()} (channel/filter/spatial splits)")
    return None


def _layouts_of(spec: Plan | LayerLayout | str, world_size: int) -> tuple[list[LayerLayout], int]:
    if isinstance(spec, Plan):
        return [spec.default_layout, *spec.layers.values()], spec.mp
    if isinstance(spec, LayerLayout):
        return [spec], 1
    if isinstance(spec, str):
        strat = parse_strategy(spec, world_size)
        return [strat.layout], strat.mp
    raise TypeError(f"expected a Plan, LayerLayout or strategy string, got {type(spec).__name__}")


def take_options(spec: Plan | LayerLayout | str, options: dict[str, Any], world_size: int) -> str:
    """Pop parallelize's `recompute` option and refuse what does not run, before any collective."""
    recompute = options.pop("recompute", None) or "none"
    layouts, mp = _layouts_of(spec, world_size)
    why = sharding_refusal(layouts, mp, recompute)
    if why is not None:
        raise UserError(why)
    return recompute


def finish(module: nn.Module, recompute: str) -> nn.Module:
    """After apply_layout: recomputation, then FSDP2 on the sample dimension (zero > 0). Collective."""
    state = getattr(module, "hybridpar", None)
    if state is None:
        return module
    if recompute == "all":
        recompute_blocks(module)
    zero = state.layouts.default.zero
    if zero and state.grid.sample > 1:
        _shard(module, state, zero)
    return module


# -- blocks ------------------------------------------------------------------------------------------

def blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units FSDP shards and recomputation checkpoints: the root's children that hold parameters
    (a ModuleList/ModuleDict is not called itself: its items are the blocks)."""
    out: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, m: nn.Module) -> None:
        for name, child in m.named_children():
            if next(child.parameters(), None) is None:
                continue
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                walk(f"{prefix}{name}.", child)
            else:
                out.append((f"{prefix}{name}", child))

    walk("", module)
    return out


# -- recomputation -----------------------------------------------------------------------------------

class _RestoreBuffers:
    """Entered around a recomputed forward: the block's buffers are put back as they were when it
    began, so running statistics are updated once per step (by the first forward)."""

    def __init__(self, block: nn.Module):
        self.block = block
        self.saved: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> None:
        self.saved = [(m, name, b, b.detach().clone()) for m in self.block.modules()
                      for name, b in m._buffers.items() if b is not None]

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for m, name, obj, value in self.saved:
                m._buffers[name] = obj
                obj.copy_(value)
        self.saved = []


def recompute_blocks(module: nn.Module) -> list[str]:
    """Wrap every block's forward (`blocks`) with non-reentrant torch.utils.checkpoint; returns their
    names. Forwards without gradients (eval, no_grad) run as they are."""
    from contextlib import nullcontext

    names = []
    for name, block in blocks(module):
        inner = block.forward

        def forward(*args: Any, _inner: Any = inner, _block: nn.Module = block, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, preserve_rng_state=True,
                              context_fn=lambda: (nullcontext(), _RestoreBuffers(_block)), **kwargs)

        block.forward = forward  # the instance's, inside nn.Module's hooks
        names.append(name)
    return names


# -- sharding (FSDP2) ---------------------------------------------------------------------------------

class ShardedSync:
    """What GradSync is to apply_layout's other paths, for FSDP-sharded modules: FSDP2 reduce-scatters
    the gradients during backward; `no_sync()` accumulates them unsynchronised."""

    enabled = False  # nothing rides along with the gradients (GradSync.carry)
    buckets: list = []

    def __init__(self, modules: list[Any]):
        self.modules = modules  # FSDPModule

    def carried(self) -> bool:
        return False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        for m in self.modules:
            m.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for m in self.modules:
                m.set_requires_gradient_sync(True)


def _shard(module: nn.Module, state: Any, zero: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    group = state.grid.replica_group
    if group.size != dist.get_world_size():
        raise UserError(f"zero={zero}: the sample ranks must be the whole world (sample-only layouts)")
    if state.grad_sync is not None:  # FSDP synchronises the gradients now
        for h in state.grad_sync.handles:
            h.remove()
    p = next(module.parameters(), None)
    device_type = p.device.type if p is not None else "cpu"
    mesh = DeviceMesh.from_group(group.pg, device_type, mesh_dim_names=("sample",))
    sharded: list[Any] = []  # FSDPModule
    for _name, block in blocks(module):
        sharded.append(fully_shard(block, mesh=mesh, reshard_after_forward=zero == 3))
    sharded.append(fully_shard(module, mesh=mesh, reshard_after_forward=zero == 3))
    if state.inputs == "global":  # each rank's gradient is its rows' share of the global loss's: sum them
        for m in sharded:
            m.set_gradient_divide_factor(1.0)
    state.grad_sync = ShardedSync(sharded)
    state.sharded = zero
