"""Applying a layout to a module: the model runs with the semantics of one process on any layout
(`apply_layout`; the public entry point is hybridpar.parallel.api.parallelize).

Parallel layers are swapped in place by module name (as torchtitan's parallelize_* functions apply
their parallel styles): Conv2d (stationary-x/y/w), Linear (row/column), BatchNorm1d/2d/3d (global
statistics). Between them, activations are DTensors over the layout's mesh (samples on `sample`,
channels on `channel_filter`), so the user's own code sees global shapes and every op it calls
computes what it computes in one process (DTensor's propagation redistributes where an op needs it;
hybridpar.parallel.dtensor.rules serves what DTensor does not). Parameters the user's code touches
between layers (norm weights, scales, embeddings) are replicated DTensors. The root module takes the
global batch as ordinary tensors and returns ordinary tensors, the same on every rank; gradients are
synchronised during backward (hybridpar.parallel.comm.grad_sync), so any loss and any torch.optim
optimizer over `module.parameters()` train as in one process.

Sample-only layouts (no channel/filter split) run without DTensor, as DDP does: each rank pushes its
samples through the model (batch norm with global statistics), and outputs are gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from hybridpar.errors import UserError
from hybridpar.parallel.comm.grad_sync import GradSync
from hybridpar.parallel.comm.log import CommLog
from hybridpar.parallel.dtensor import rules as dtensor_rules
from hybridpar.parallel.dtensor.boundary import distribute_input, gather_output, replicate_param
from hybridpar.parallel.mesh import Group, Meshes, ProcessGrid, build_grid, build_meshes
from hybridpar.parallel.sample_io import gather_samples, samples_mixed, split_samples
from hybridpar.parallel.state import ShardInfo
from hybridpar.parallel.styles import concat
from hybridpar.parallel.styles.conv import DistConv2d, DistLinear
from hybridpar.parallel.styles.norm import DistBatchNorm
from hybridpar.parallel.styles.table import splits_as_conv, style_for
from hybridpar.plans import LayerLayout, Plan, parse_strategy

if TYPE_CHECKING:
    from hybridpar.parallel.materialize import Materializer

INPUT_MODES = ("global", "sample_shard")


@dataclass(frozen=True)
class Layouts:
    default: LayerLayout
    per_module: dict[str, LayerLayout] = field(default_factory=dict)

    def of(self, name: str) -> LayerLayout:
        return self.per_module.get(name, self.default)

    @property
    def all(self) -> list[LayerLayout]:
        return [self.default, *self.per_module.values()]


def as_layouts(spec: Plan | LayerLayout | str, world_size: int | None = None) -> Layouts:
    layouts = _as_layouts(spec, world_size)
    spatial = next((lay for lay in layouts.all if lay.spatial > 1), None)
    if spatial is not None:
        _refuse_spatial(spatial, layouts)
    return layouts


def _refuse_spatial(spatial: LayerLayout, layouts: Layouts) -> None:
    """What spatial layouts do not run yet, refused before any collective. (Spatial x channel/filter
    runs: hybridpar.parallel.styles.spatial_layers.SpatialDistConv.)"""
    if any(lay != layouts.default for lay in layouts.all):
        raise UserError(f"layout {spatial.to_strategy()}: a plan whose layers use different layouts with spatial "
                        "splits is not run yet; give every layer the same sample x spatial layout")


def _as_layouts(spec: Plan | LayerLayout | str, world_size: int | None = None) -> Layouts:
    if isinstance(spec, Plan):
        if spec.mp > 1:
            raise UserError("plan has mp > 1: hybridpar.parallelize runs it (pipeline.module), not apply_layout")
        return Layouts(spec.default_layout, dict(spec.layers))
    if isinstance(spec, LayerLayout):
        return Layouts(spec)
    if isinstance(spec, str):
        strat = parse_strategy(spec, world_size)
        if strat.mp > 1:
            raise UserError(f"strategy {spec!r} has mp > 1: not a channel/filter/sample layout")
        return Layouts(strat.layout)
    raise TypeError(f"expected a Plan, LayerLayout or strategy string, got {type(spec).__name__}")


def grid_shape(layouts: Layouts) -> tuple[int, int]:
    """(S, G) of the default layout: the boundary layout of every activation."""
    d = layouts.default
    return d.sample, d.channel * d.filter


def grid_keys(layouts: Layouts) -> list[tuple[int, int]]:
    """Every (S, G) the layouts use, in one order all ranks share."""
    return sorted({(lay.sample, lay.channel * lay.filter) for lay in layouts.all})


def check_parallelizable(module: nn.Module, layouts: Layouts, batch: int | None = None) -> None:
    """Everything that would make parallelize fail, raised as a UserError before any process starts."""
    s, g = grid_shape(layouts)
    if batch is not None and batch % s:
        raise UserError(f"global batch {batch} is not divisible by the sample degree {s}")
    if layouts.default.spatial > 1:
        from hybridpar.parallel.styles.spatial_layers import spatial_refusal

        for name, m in module.named_modules():
            why = spatial_refusal(m)
            if why is not None:
                raise UserError(f"{layouts.default.to_strategy()}: module '{name or '<model>'}' ({why}) cannot run "
                                "with spatial splits; use a sample-only layout for this model")
    for name, lay in layouts.per_module.items():
        try:
            sub = module.get_submodule(name)
        except AttributeError:
            raise UserError(f"plan names module {name!r}, which the model does not have") from None
        if (lay.sample, lay.g_size) != (s, g) and not splits_as_conv(sub):
            raise UserError(f"{name}: only convolutions may use a layout with another sample/channel grid "
                            f"than the default ({lay.to_strategy()} vs {layouts.default.to_strategy()})")
        if (lay.sample, lay.g_size) != (s, g) and g == 1:
            raise UserError(f"{name}: a channel/filter layout inside a sample-only model is not supported; "
                            "give the model a channel/filter default layout")
        if batch is not None and batch % lay.sample:
            raise UserError(f"global batch {batch} is not divisible by the sample degree {lay.sample} of {name}")
    for name, m in module.named_modules():
        if name in layouts.per_module and type(m) is nn.Conv2d and not splits_as_conv(m):
            raise UserError(f"{name}: grouped/depthwise convolution (groups={m.groups}) or padding_mode="
                            f"{m.padding_mode!r} cannot take its own channel/filter layout; it runs "
                            "replicated over channel_filter in the default layout")


@dataclass
class ParallelState:
    """What parallelize did: the grids, and where each local tensor sits in the undistributed one."""

    grid: ProcessGrid  # the default layout's grid (boundary layout of activations)
    layouts: Layouts
    bn_stats: str
    grids: dict[tuple[int, int], ProcessGrid] = field(default_factory=dict)  # (S, G) -> grid
    shard_fns: dict[str, Callable[[], dict[str, ShardInfo]]] = field(default_factory=dict)  # module name ->
    param_grid: dict[int, tuple[int, int]] = field(default_factory=dict)  # id(param) -> (S, G), if not default
    meshes: Meshes | None = None  # when activations are DTensors
    inputs: str = "global"
    grad_sync: GradSync | None = None

    def group_of(self, p: torch.Tensor) -> Group:
        """The group a local (non-DTensor) parameter's gradient is summed over: the ranks holding the same
        piece of it for other samples (and other spatial pieces, with spatial splits)."""
        return self.grids[self.param_grid.get(id(p), (self.grid.sample, self.grid.g_size))].stats_group

    def shards(self) -> dict[str, ShardInfo]:
        out = {}
        for mname, fn in self.shard_fns.items():
            for attr, info in fn().items():
                out[f"{mname}.{attr}" if mname else attr] = info
        return out


def apply_layout(module: nn.Module, spec: Plan | LayerLayout | str, *, inputs: str = "global",
                 grid: ProcessGrid | None = None, grids: dict[tuple[int, int], ProcessGrid] | None = None,
                 bn_stats: str = "global", comm_log: CommLog | None = None, extra_ops: Iterable = (),
                 materialize: Materializer | None = None) -> nn.Module:
    """Make `module` run `spec` (a Plan, a LayerLayout or a strategy string such as "sample=2,channel=2")
    on the current torch.distributed world, in place; returns the module, with `.hybridpar` set to a
    ParallelState. Collective: every rank calls it with the same arguments.

    inputs="global": every rank passes the same global batch and gets the whole outputs; gradients
    are summed over sample groups (the loss is the global batch's). inputs="sample_shard": each rank
    passes only its sample group's samples (batch / sample degree) and gets those samples' outputs;
    gradients are averaged over sample groups, as DDP does, so use a per-rank mean loss.

    `materialize` (hybridpar.parallel.materialize.Materializer): `module`'s weights are on meta; once
    the parallel layers are cut, it gives this rank's local tensors their values (on its `.device`).
"""
    if inputs not in INPUT_MODES:
        raise UserError(f"inputs must be one of {', '.join(INPUT_MODES)}, got {inputs!r}")
    layouts = as_layouts(spec, dist.get_world_size())
    check_parallelizable(module, layouts)
    grids = dict(grids or {})
    if grid is not None:
        grids[(grid.sample, grid.g_size)] = grid
    default_key = grid_shape(layouts)
    for key in grid_keys(layouts):  # same order on every rank: group creation is collective
        if key not in grids:
            facts = {(lay.channel, lay.filter) for lay in layouts.all if (lay.sample, lay.g_size) == key}
            log = comm_log or next((g.comm_log for g in grids.values()), None)
            grids[key] = build_grid(*key, facts, log, spatial=layouts.default.spatial)
    state = ParallelState(grids[default_key], layouts, bn_stats, grids, inputs=inputs)
    if default_key[1] > 1 or layouts.default.spatial > 1:
        dtensor_rules.install(extra_ops)
        state.meshes = build_meshes(layouts.default, materialize.device.type if materialize is not None
                                    else _device_type(module))
    for name, m in list(module.named_modules()):
        new = _replacement(name, m, layouts.of(name), state)
        if new is not None:
            if state.meshes is not None:
                setattr(new, "meshes", state.meshes)  # noqa: B010 - our layers' DTensor boundary
            _set_submodule(module, name, new)
    if materialize is not None:  # every local tensor is known now: only this rank's pieces get bytes
        materialize(module, state)
    if state.meshes is not None:
        _replicate_the_rest(module, state.meshes)
        concat.install(module, state.grid, state.meshes)  # torch.cat along channels in the model's forward
    _install_io(module, state)
    setattr(module, "hybridpar", state)  # noqa: B010 - an attribute nn.Module's typing does not know
    mesh_groups: dict[str | tuple[str, ...], Group] = {"sample": state.grid.replica_group,
                                                       "channel_filter": state.grid.sample_group}
    if state.meshes is not None and state.meshes.spatial:
        mesh_groups = _act_mesh_groups(state.meshes)
    elif state.meshes is not None:  # Partial over both: one sum over the whole mesh (= the world, build_grid)
        ranks = tuple(range(dist.get_world_size()))
        mesh_groups[("sample", "channel_filter")] = Group(ranks, dist.group.WORLD, dist.get_rank())
    state.grad_sync = GradSync(module.parameters(), state.group_of, mesh_groups, state.grid.comm_log,
                               average_over=state.grid.sample if inputs == "sample_shard" else 1,
                               ordered=state.grid.spatial > 1)
    return module


def state_of(module: nn.Module) -> ParallelState:
    """What `apply_layout` did to `module` (UserError if nothing)."""
    state = getattr(module, "hybridpar", None)
    if not isinstance(state, ParallelState):
        raise UserError("the module was not parallelized with hybridpar.parallelize")
    return state


def _device_type(module: nn.Module) -> str:
    p = next(module.parameters(), None)
    # meta: the dry run's shape-only pass (hybridpar.parallel.check) on a CPU mesh
    return p.device.type if p is not None and p.device.type != "meta" else "cpu"


def _replicate_the_rest(module: nn.Module, meshes) -> None:
    """Parameters and buffers outside our parallel layers become replicated DTensors, so the user's
    code between layers (norms, scales, embeddings, position tables) can mix them with activations."""
    ours = _parallel_layer_types()
    for m in module.modules():
        if isinstance(m, ours):
            continue
        for pname, p in list(m.named_parameters(recurse=False)):
            if p is not None and not isinstance(p, DTensor):
                setattr(m, pname, nn.Parameter(replicate_param(p, meshes), requires_grad=p.requires_grad))
        for bname, b in list(m.named_buffers(recurse=False)):
            if b is not None and not isinstance(b, DTensor):
                m._buffers[bname] = replicate_param(b, meshes)


def _parallel_layer_types() -> tuple[type[nn.Module], ...]:
    from hybridpar.parallel.styles.spatial_layers import SpatialLayer

    return (DistConv2d, DistLinear, DistBatchNorm, SpatialLayer)


def _act_mesh_groups(meshes: Meshes) -> dict[str | tuple[str, ...], Group]:
    """A Group per set of the activation mesh's dims (a DTensor gradient is Partial over any of them,
    e.g. (sample, height) for a replicated parameter used on split activations). Collective: every
    rank creates every group, in one order."""
    from itertools import combinations

    from hybridpar.parallel.mesh import MeshDims, new_groups

    names = tuple(meshes.act.mesh_dim_names or ())
    dims = MeshDims(names, tuple(meshes.act.size(i) for i in range(len(names))))
    rank, world = dist.get_rank(), dist.get_world_size()
    big = [n for n in names if dims.sizes[names.index(n)] > 1]
    wanted: dict[str | tuple[str, ...], tuple[int, ...]] = {n: dims.group_of(rank, n) for n in names}
    for k in range(2, len(big) + 1):
        for over in combinations(big, k):
            wanted[over] = dims.group_of(rank, *over)
    sets = [g for k in range(1, len(big) + 1) for over in combinations(big, k) for g in dims.groups(*over)]
    made = new_groups([g for g in dict.fromkeys(sets) if 1 < len(g) < world])
    whole = Group(tuple(range(world)), dist.group.WORLD, rank)
    return {key: (whole if len(ranks) == world else made.get(ranks, Group(ranks, None, 0)))
            for key, ranks in wanted.items()}


def _install_io(module: nn.Module, state: ParallelState) -> None:
    """The root takes ordinary tensors and returns ordinary tensors (see parallelize's doc)."""
    sample_shard = state.inputs == "sample_shard"
    if state.meshes is not None:
        meshes = state.meshes

        def pre(_m, args, kwargs):
            return distribute_input(args, meshes, sample_shard=sample_shard), \
                distribute_input(kwargs, meshes, sample_shard=sample_shard)

        def post(_m, _args, _kwargs, out):
            return gather_output(out, meshes, state.grid, sample_shard=sample_shard)
    else:
        grid = state.grid
        checked = [grid.sample == 1]

        def pre(_m, args, kwargs):
            if grid.sample == 1:
                return None
            mine = (args, kwargs) if sample_shard else (split_samples(args, grid), split_samples(kwargs, grid))
            if not checked[0]:  # once, before the first step's collectives: refuse a forward that mixes samples
                checked[0] = True
                _refuse_mixed_samples(module, *mine, grid)
            return None if sample_shard else mine

        def post(_m, _args, _kwargs, out):
            if sample_shard or grid.sample == 1:
                return None
            return gather_samples(out, grid)

    module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    module.register_forward_hook(post, with_kwargs=True)


def _refuse_mixed_samples(module: nn.Module, args, kwargs, grid) -> None:
    """Every rank checks its own rows (hybridpar.parallel.sample_io.samples_mixed) and all agree (one
    unlogged 1-element allreduce, not part of a step), so either all raise or none does."""
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_flatten((args, kwargs))[0]):
        return  # the dry run (meta tensors, fake world): there are no values to compare
    reason = samples_mixed(module, args, kwargs)
    flag = torch.tensor([1.0 if reason else 0.0], device=_device_of(module))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=grid.replica_group.pg)
    if flag.item() > 0:
        raise UserError(f"sample={grid.sample}: " + (reason or "another rank found that the model's forward mixes "
                                                     "samples; a sample-only layout would train a different model"))


def _device_of(module: nn.Module):
    p = next(module.parameters(), None)
    return p.device if p is not None else "cpu"


def _replacement(name: str, m: nn.Module, lay: LayerLayout, state: ParallelState) -> nn.Module | None:
    style = style_for(m, lay)
    return None if style is None else style(name, m, lay, state)


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, new)
