"""The sample dimension's parameters sharded (FSDP2, `zero=2|3`) and activation recomputation
(`recompute="all"`), applied by `parallelize` after the layout (hybridpar.parallel.apply).

Sharding: `zero=3` (ZeRO-3: parameters gathered for a block's forward, freed, gathered again for its
backward) or `zero=2` (gathered once, kept until the block's backward is done: FSDP2
`reshard_after_forward=False`) first runs apply_layout as it is, then hands gradient synchronisation
to FSDP2: `fully_shard` on every block (`blocks`) and on the root, over the `sample` dimension of the
plan's one DeviceMesh (a 1-D mesh of the sample ranks for sample-only layouts, which build none).
A mixed per-block plan (its layers' layouts differ in zero level only, hybridpar.layout.blocks) shards
the blocks at zero 2|3, each at its own level, and keeps the others replicated with GradSync (FSDP's
ignored parameters); recomputation likewise runs on the blocks a plan names (Plan.recompute_blocks).
With channel/filter layouts our layers stay on the other dimensions and FSDP shards, over the sample
ranks, what each rank holds of them (its local weight pieces); what FSDP cannot hold there (replicated
DTensor parameters, pieces summed over more ranks than the sample ranks) stays with GradSync
(ShardedSync.rest). The convention stays apply_layout's: under inputs="global" a rank's gradient is
its rows' share of the global loss's and the reduce-scatter sums them (divide factor 1); under
inputs="sample_shard" it averages them (DDP's). On gloo the reductions are sums (gloo has no AVG or
PREMUL_SUM). `mixed_precision="bf16"`: FSDP2's MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32), norms in their own fp32 units. FSDP's all-gathers and reduce-scatters are
recorded in the comm log as they are issued (`_logged_comms`), tagged `fsdp:<block>:fwd|bwd|grad`.

Recomputation: each block's forward runs under torch.utils.checkpoint (non-reentrant, RNG state
preserved), so only block inputs are kept from forward to backward. A recomputed forward restores
the block's buffers when it is done, so batch-norm running statistics (and any other buffer a forward
updates) change once per step, as in one process; with channel/filter layouts it runs under the
DTensor rules the forward ran under (hybridpar.parallel.dtensor.rules).
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
from hybridpar.host_allocator import give_back_free_memory, return_large_blocks
from hybridpar.layout.blocks import block_of, block_zeros, same_but_zero
from hybridpar.plans import LayerLayout, Plan, parse_strategy

RECOMPUTE = ("none", "all")
MIXED_PRECISION = ("none", "bf16")

__all__ = ["MIXED_PRECISION", "RECOMPUTE", "blocks", "finish", "recompute_blocks", "sharding_refusal", "take_options"]


def sharding_refusal(layouts: list[LayerLayout], mp: int, recompute: str | tuple[str, ...],
                     named: dict[str, LayerLayout] | None = None) -> str | None:
    """Why `zero` / `recompute` cannot run with these layouts yet (None: they can). `recompute`: "none",
    "all" or the blocks that recompute (a plan's recompute_blocks); `named`: the plan's per-layer
    layouts, whose zero levels must agree inside each block (a mixed per-block plan: blocks replicated,
    zero=2 or zero=3 over one split). Pure: before any rank starts (hybridpar train's checks) and before
    parallelize's first collective."""
    if isinstance(recompute, str) and recompute not in RECOMPUTE:
        return f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}"
    zeroed = next((lay for lay in layouts if lay.zero), None)
    if zeroed is not None:
        why = zeroed.zero_refusal()
        if why is not None:
            return why
        if mp > 1:
            return f"zero={zeroed.zero} does not run with model parallelism (mp > 1) yet"
        if any(not same_but_zero(lay, layouts[0]) for lay in layouts):
            return (f"zero={zeroed.zero}: a plan whose layers differ in their sample, channel or filter degrees "
                    "does not run with sharding yet; give every layer the same split (blocks may differ in zero level)")
        why = block_zeros(named or {}, layouts[0])[1]
        if why is not None:
            return why
    if recompute != "none":
        if mp > 1:
            return f"recompute={recompute} does not run with model parallelism (mp > 1) yet"
        split = next((lay for lay in layouts if lay.spatial > 1), None)
        if split is not None:
            return (f"recompute={recompute} runs with sample and channel/filter layouts for now, not with "
                    f"{split.to_strategy()} (spatial splits)")
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


def plan_recompute(spec: Plan | LayerLayout | str,
                   asked: str | tuple[str, ...] | None = None) -> str | tuple[str, ...]:
    """What recomputes in a run of `spec` (the one rule of parallelize and hybridpar train): the user's
    explicit ask first (`asked`: "all", from `train --recompute all` or parallelize's recompute=, or the
    blocks named; a bad value passes on to sharding_refusal); else the plan's "all"; else its per-block
    choice (recompute_blocks); else "none". asked None or "none" asks nothing: "none" is the CLI's
    default, so it cannot turn a plan's choice off. Strategies and layouts ask nothing themselves."""
    if asked is not None and asked != "none":
        return asked
    if isinstance(spec, Plan):
        if spec.recompute == "all":  # (a validated plan never has both; "all" is the larger ask)
            return "all"
        if spec.recompute_blocks is not None:
            return tuple(spec.recompute_blocks)
    return "none"


def take_options(spec: Plan | LayerLayout | str, options: dict[str, Any],
                 world_size: int) -> tuple[str | tuple[str, ...], str]:
    """Pop parallelize's `recompute` and `mixed_precision` options and refuse what does not run, before any
    collective. Returns (recompute, mixed_precision); recompute: `plan_recompute`'s rule (the option where
    it asks something, else the plan's "all" or per-block choice)."""
    recompute = plan_recompute(spec, options.pop("recompute", None))
    mixed = options.pop("mixed_precision", None) or "none"
    if mixed not in MIXED_PRECISION:
        raise UserError(f"mixed_precision must be one of {', '.join(MIXED_PRECISION)}, got {mixed!r}")
    layouts, mp = _layouts_of(spec, world_size)
    why = sharding_refusal(layouts, mp, recompute, dict(spec.layers) if isinstance(spec, Plan) else None)
    if why is None and mixed == "bf16" and len({lay.zero for lay in layouts}) > 1:
        # FSDP2's policy casts the root's inputs to bf16, which a replicated block's fp32 weights refuse
        why = "mixed_precision=bf16 with a plan whose blocks differ in zero level does not run yet"
    if why is not None:
        raise UserError(why)
    return recompute, mixed


def finish(module: nn.Module, recompute: str | tuple[str, ...], mixed_precision: str = "none") -> nn.Module:
    """After apply_layout: recomputation ("all", or these blocks), then FSDP2 on the sample dimension
    for the blocks whose zero level is 2 or 3 (`zero_of_blocks`). Collective.
    mixed_precision="bf16": FSDP2 gathers and computes with bf16 copies of the fp32 parameters and
    reduce-scatters the gradients in fp32 (MixedPrecisionPolicy); only with zero (else nothing)."""
    state = getattr(module, "hybridpar", None)
    if state is None:
        return module
    if recompute != "none":
        recompute_blocks(module, None if recompute == "all" else tuple(recompute))
    zeros = zero_of_blocks(module, state.layouts.per_module, state.layouts.default)
    if any(zeros.values()) and state.grid.sample > 1:
        _shard(module, state, zeros, mixed_precision)
    return module


def zero_of_blocks(module: nn.Module, layers: dict[str, LayerLayout], default: LayerLayout) -> dict[str, int]:
    """Each block's zero level (`blocks`; "" the root's own parameters): the level its layers' layouts
    carry (hybridpar.layout.blocks.block_zeros), else the default layout's."""
    named, why = block_zeros(layers, default)
    if why is not None:
        raise UserError(why)
    out = {name: named.get(name, named.get(block_of(name), default.zero)) for name, _ in blocks(module)}
    out[""] = named.get("", default.zero)
    return out


# -- blocks ------------------------------------------------------------------------------------------

def blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units FSDP shards and recomputation checkpoints: the root's children that hold parameters;
    a ModuleList/ModuleDict is not called itself, and a Sequential of numbered items is a stack (a
    ResNet stage): their items are the blocks. The cost model names the same blocks from module names
    alone (hybridpar.cost.memory.block_of: "layer1.0"); a ModuleDict's items are the one case it
    cannot tell apart (it prices the dict as one block)."""
    out: list[tuple[str, nn.Module]] = []

    def stack(child: nn.Module, top: bool) -> bool:
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):  # never called itself: always its items
            return True
        return top and isinstance(child, nn.Sequential) and all(n.isdigit() for n, _ in child.named_children())

    def walk(prefix: str, m: nn.Module) -> None:
        for name, child in m.named_children():
            if next(child.parameters(), None) is None:
                continue
            if stack(child, not prefix):  # a top-level Sequential one level down: "layer1.0", as block_of
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


class _ForwardModes:
    """Entered around a recomputed forward (in backward, after the root's forward hook has left our
    DTensor rules): the rules the first forward ran under (hybridpar.parallel.dtensor.rules, with the
    math SDPA kernel the root pins), so the recomputation computes what the forward did."""

    def __init__(self, modes: list[Any]):
        self.modes = modes
        self.entered: list[Any] = []

    def __enter__(self) -> None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if not self.modes:
            return
        for m in self.modes:
            m.__enter__()
            self.entered.append(m)
        pin = sdpa_kernel([SDPBackend.MATH])
        pin.__enter__()
        self.entered.append(pin)

    def __exit__(self, *exc: object) -> None:
        while self.entered:
            self.entered.pop().__exit__(None, None, None)


def _active_rules() -> list[Any]:
    from torch.overrides import _get_current_function_mode_stack

    from hybridpar.parallel.dtensor.rules import DTensorRules

    return [m for m in _get_current_function_mode_stack() if isinstance(m, DTensorRules)]


def recompute_blocks(module: nn.Module, only: tuple[str, ...] | None = None) -> list[str]:
    """Wrap every block's forward (`blocks`; `only`: these of them, a UserError naming one the module
    does not have) with non-reentrant torch.utils.checkpoint; returns their names. Forwards without
    gradients (eval, no_grad) run as they are. A block already wrapped is left as it is (parallelize
    honours a plan's choice; hybridpar train's --recompute all may ask again)."""
    from contextlib import nullcontext

    names = []
    found = blocks(module)
    unknown = sorted(set(only or ()) - {name for name, _ in found})
    if unknown:
        raise UserError(f"recompute_blocks: the model has no block {unknown[0]!r} (its blocks: "
                        f"{', '.join(name for name, _ in found[:8])}{' ...' if len(found) > 8 else ''})")
    for name, block in found:
        if only is not None and name not in only:
            continue
        names.append(name)
        if getattr(block, "_hybridpar_recomputed", False):
            continue
        setattr(block, "_hybridpar_recomputed", True)  # noqa: B010
        inner = block.forward

        def forward(*args: Any, _inner: Any = inner, _block: nn.Module = block, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            modes = _active_rules()  # channel/filter layouts: the forward runs under our DTensor rules
            return checkpoint(_inner, *args, use_reentrant=False, preserve_rng_state=True,
                              context_fn=lambda: (nullcontext(), _Recomputing(_block, modes)), **kwargs)

        block.forward = forward  # the instance's, inside nn.Module's hooks
    return names


class _Recomputing:
    def __init__(self, block: nn.Module, modes: list[Any]):
        self.parts = (_ForwardModes(modes), _RestoreBuffers(block))

    def __enter__(self) -> None:
        for p in self.parts:
            p.__enter__()

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.parts):
            p.__exit__(*exc)


# -- sharding (FSDP2) ---------------------------------------------------------------------------------

class ShardedSync:
    """What GradSync is to apply_layout's other paths, for FSDP-sharded modules: FSDP2 reduce-scatters
    the sharded parameters' gradients during backward; `rest` (a GradSync, or None) synchronises the
    parameters FSDP does not hold (replicated DTensors, shards summed over more than the sample ranks);
    `no_sync()` accumulates both unsynchronised."""

    enabled = False  # nothing rides along with the gradients (GradSync.carry)
    buckets: list = []

    def __init__(self, modules: list[Any], rest: Any = None):
        self.modules = modules  # FSDPModule
        self.rest = rest

    def carried(self) -> bool:
        return False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        for m in self.modules:
            m.set_requires_gradient_sync(False)
        try:
            if self.rest is not None:
                with self.rest.no_sync():
                    yield
            else:
                yield
        finally:
            for m in self.modules:
                m.set_requires_gradient_sync(True)


def _phase() -> str:
    """"bwd" while autograd runs a backward on this thread (FSDP gathers a resharded block again), else "fwd"."""
    return "bwd" if torch._C._current_graph_task_id() != -1 else "fwd"


def _logged_comms(log: Any, tag: str) -> tuple[Any, Any]:
    """FSDP2's own all-gather and reduce-scatter (its DefaultAllGather/DefaultReduceScatter, so FSDP
    treats them as its defaults) recording each call in the comm log as it is issued, with the bytes
    of the buffers it sends: the gathered result, the reduce-scatter's input (CommLog's convention), so
    a step's log can be checked against hybridpar.cost.layout_comm.fsdp_collectives."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class Gather(DefaultAllGather):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> Any:
            log.record("allgather", dist.get_world_size(group), output_tensor.numel() * output_tensor.element_size(),
                       f"fsdp:{tag}:{_phase()}")
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class Scatter(DefaultReduceScatter):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            log.record("reduce_scatter", dist.get_world_size(group), input_tensor.numel() * input_tensor.element_size(),
                       f"fsdp:{tag}:grad")
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    return Gather(), Scatter()


def _sample_mesh(module: nn.Module, state: Any, zero: int) -> Any:
    """The sample dimension of the plan's DeviceMesh (channel/filter layouts), or a 1-D mesh over the
    sample ranks (sample-only layouts build no DeviceMesh)."""
    from torch.distributed.device_mesh import DeviceMesh

    if state.meshes is not None:
        return state.meshes.full["sample"]
    group = state.grid.replica_group
    if group.size != dist.get_world_size():
        raise UserError(f"zero={zero}: the sample ranks must be the whole world (sample-only layouts)")
    p = next(module.parameters(), None)
    return DeviceMesh.from_group(group.pg, p.device.type if p is not None else "cpu", mesh_dim_names=("sample",))


def _not_sharded(module: nn.Module, state: Any, sample_ranks: tuple[int, ...]) -> list[nn.Parameter]:
    """Parameters FSDP cannot hold on the sample dimension: DTensors (replicated over the activation
    mesh, which includes `sample`) and local shards whose gradient is summed over other ranks than this
    rank's sample ranks. GradSync keeps synchronising these."""
    from torch.distributed.tensor import DTensor

    return [p for p in module.parameters()
            if isinstance(p, DTensor) or (p.requires_grad and tuple(sorted(state.group_of(p).ranks)) != sample_ranks)]


def _norm_units(module: nn.Module) -> list[tuple[str, nn.Module, Any]]:
    """Under bf16: each batch/layer/group norm its own FSDP unit with fp32 parameters, its output cast to
    bf16 for the layers after it (inputs as they come: the norm computes its statistics in fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from hybridpar.parallel.styles.norm import DistBatchNorm

    kinds = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, DistBatchNorm)
    keep = MixedPrecisionPolicy(output_dtype=torch.bfloat16, cast_forward_inputs=False)
    return [(name, m, keep) for name, m in module.named_modules()
            if name and isinstance(m, kinds) and next(m.parameters(recurse=False), None) is not None]


def _replicated(module: nn.Module, zeros: dict[str, int]) -> list[nn.Parameter]:
    """The parameters of the blocks a mixed plan keeps replicated (zero 0; "" the root's own)."""
    out = [p for name, block in blocks(module) if not zeros.get(name) for p in block.parameters()]
    if not zeros.get(""):
        inside = {id(p) for _, block in blocks(module) for p in block.parameters()}
        out += [p for p in module.parameters() if id(p) not in inside]
    return out


def _shard(module: nn.Module, state: Any, zeros: dict[str, int], mixed_precision: str = "none") -> None:
    """FSDP2 on the blocks whose zero level is 2 or 3 (`zeros`) and on the root; the replicated blocks'
    parameters are FSDP's ignored ones and keep GradSync (ShardedSync.rest)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from hybridpar.parallel.comm.grad_sync import GradSync

    zero = max(zeros.values())
    # FSDP's per-step blocks fragment a heap that keeps freed memory: mmapped from here on, where
    # glibc was started to back them with huge pages (else nothing changes)
    return_large_blocks()
    mesh = _sample_mesh(module, state, zero)
    ranks = tuple(sorted(dist.get_process_group_ranks(mesh.get_group())))
    kept = list({id(p): p for p in [*_not_sharded(module, state, ranks), *_replicated(module, zeros)]}.values())
    old, rest = state.grad_sync, None
    if old is not None:  # FSDP synchronises the gradients of what it shards now
        for h in old.handles:
            h.remove()
        if kept:
            rest = GradSync(kept, old.group_of, old.mesh_groups, old.log, average_over=old.average_over,
                            bucket_bytes=old.bucket_bytes, overlap=old.overlap, ordered=old.ordered)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed_precision == "bf16" else MixedPrecisionPolicy()
    ignored = set(kept)
    # the root always: FSDP2's root runs the lazy init and the prefetching of the blocks under it
    units = [(name, block, policy) for name, block in [*blocks(module), ("", module)] if zeros.get(name) or not name]
    if mixed_precision == "bf16":  # norms keep fp32 weights (their kernels refuse bf16 weights on fp32 statistics)
        units = [*_norm_units(module), *units]
    sharded: list[Any] = []  # FSDPModule
    for name, block, unit_policy in units:
        level = zeros.get(name, zero)  # a norm unit (bf16 only: every block sharded) as the default
        m = fully_shard(block, mesh=mesh, reshard_after_forward=level == 3, mp_policy=unit_policy,
                        ignored_params=ignored or None)
        gather, scatter = _logged_comms(state.grid.comm_log, name)
        m.set_custom_all_gather(gather)
        m.set_custom_reduce_scatter(scatter)
        sharded.append(m)
    gloo = dist.get_backend(mesh.get_group()) == "gloo"
    for m in sharded:
        if state.inputs == "global":  # each rank's gradient is its rows' share of the global loss's: sum them
            m.set_gradient_divide_factor(1.0)
        if gloo:  # fp32/bf16 gradients: FSDP would reduce with AVG / PREMUL_SUM, which gloo refuses
            m.set_force_sum_reduction_for_comms(True)
    state.grad_sync = ShardedSync(sharded, rest)
    state.sharded = zero
    give_back_free_memory()  # the whole blocks fully_shard just replaced by shards
