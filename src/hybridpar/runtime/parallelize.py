"""`parallelize(module, layout)`: replace a CNN's standard layers in place, keyed by module name (as
torch.distributed.tensor.parallel.parallelize_module does), so no trace of forward is needed.

Activations between layers are split on samples over the S sample groups and on channels into
G = P_C*P_F pieces inside a sample group; every conv/linear layout (channel, filter) with
channel*filter = G keeps that boundary layout, so per-layer layouts with the default's (S, G) mix
freely without redistribution. Pointwise ops, pooling, residual adds, global average pooling and
flatten act on the local piece unchanged. A convolution whose layout has another (S, G) (e.g.
`sample=4` inside a `sample=2,channel=2` model) redistributes its input into its own layout and its
output back (hybridpar.runtime.redistribute), so user forward code never sees mixed layouts.
Batch norm always runs in the default layout; Linear layers must use the default (S, G).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from hybridpar.errors import UserError
from hybridpar.plans import LayerLayout, Plan, parse_strategy
from hybridpar.runtime.comm_log import CommLog
from hybridpar.runtime.shard import piece_sizes, ranges

# Modules that act on a channel piece unchanged (no parameters, no mixing across channels).
LOCAL_OK = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Hardswish,
            nn.Identity, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d,
            nn.Flatten, nn.Dropout, nn.Sequential, nn.ModuleList, nn.ModuleDict)


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
    if isinstance(spec, Plan):
        if spec.mp > 1:
            raise UserError("plan has mp > 1: use hybridpar.runtime.engine.make_engine (MP engine)")
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
    for name, lay in layouts.per_module.items():
        try:
            sub = module.get_submodule(name)
        except AttributeError:
            raise UserError(f"plan names module {name!r}, which the model does not have") from None
        if (lay.sample, lay.channel * lay.filter) != (s, g) and not isinstance(sub, (nn.Conv2d, nn.BatchNorm2d)):
            raise UserError(f"{name}: only convolutions may use a layout with another sample/channel grid "
                            f"than the default ({lay.to_strategy()} vs {layouts.default.to_strategy()})")
        if batch is not None and batch % lay.sample:
            raise UserError(f"global batch {batch} is not divisible by the sample degree {lay.sample} of {name}")
    for name, m in module.named_modules():
        lay = layouts.of(name)
        own_g = lay.channel * lay.filter
        if isinstance(m, nn.Conv2d):
            if own_g == 1 and (lay.sample, own_g) == (s, g):
                continue  # stays a plain Conv2d
            if m.groups != 1:
                raise UserError(f"{name}: grouped/depthwise convolution (groups={m.groups}) cannot be "
                                "channel/filter-split or redistributed; give it the default sample-only layout")
            if m.padding_mode != "zeros":
                raise UserError(f"{name}: padding_mode={m.padding_mode!r} is not supported distributed")
        elif g == 1 or isinstance(m, (nn.Linear, nn.BatchNorm2d, *LOCAL_OK)):
            continue
        elif any(True for _ in m.parameters(recurse=False)):
            raise UserError(f"{name}: {type(m).__name__} has parameters and no channel/filter-parallel "
                            "form; use a sample-only layout")


@dataclass
class ParallelState:
    """What parallelize did: the grids, and where each local tensor sits in the undistributed one."""

    grid: object  # the default layout's grid (boundary layout of activations)
    layouts: Layouts
    bn_stats: str
    grids: dict = field(default_factory=dict)  # (S, G) -> ProcessGrid
    shard_fns: dict[str, object] = field(default_factory=dict)  # module name -> () -> {attr: ShardInfo}
    param_grid: dict[int, tuple[int, int]] = field(default_factory=dict)  # id(param) -> (S, G), if not default

    def shards(self) -> dict:
        out = {}
        for mname, fn in self.shard_fns.items():
            for attr, info in fn().items():
                out[f"{mname}.{attr}" if mname else attr] = info
        return out


def parallelize(module: nn.Module, spec: Plan | LayerLayout | str, *, grid=None, grids: dict | None = None,
                bn_stats: str = "global", comm_log: CommLog | None = None) -> nn.Module:
    """Replace `module`'s Conv2d, Linear and BatchNorm2d layers in place by their distributed forms for
    this rank (torch.distributed must be initialised). Returns the module, with `.hybridpar` set to a
    ParallelState. Collective: every rank calls it with the same arguments. `grid`/`grids` reuse
    process grids built earlier (keyed by (S, G)); missing ones are built here."""
    import torch.distributed as dist

    from hybridpar.runtime.grid import build_grid

    layouts = as_layouts(spec, dist.get_world_size())
    check_parallelizable(module, layouts)
    grids = dict(grids or {})
    if grid is not None:
        grids[(grid.sample, grid.g_size)] = grid
    default_key = grid_shape(layouts)
    for key in grid_keys(layouts):  # same order on every rank: group creation is collective
        if key not in grids:
            facts = {(lay.channel, lay.filter) for lay in layouts.all if (lay.sample, lay.channel * lay.filter) == key}
            log = comm_log or next((g.comm_log for g in grids.values()), None)
            grids[key] = build_grid(*key, facts, log)
    state = ParallelState(grids[default_key], layouts, bn_stats, grids)
    for name, m in list(module.named_modules()):
        new = _replacement(name, m, layouts.of(name), state, bn_stats)
        if new is not None:
            _set_submodule(module, name, new)
    module.hybridpar = state
    if any(g.g_size > 1 for g in grids.values()):
        from hybridpar.runtime.channel_ops import install

        install(module, state.grid)  # torch.cat along channels in the model's forward
    return module


def _replacement(name, m, lay: LayerLayout, state: ParallelState, bn_stats):
    from hybridpar.runtime.conv import ConvComm, DistConv2d, DistLinear, conv_geometry, weight_block
    from hybridpar.runtime.norm import DistBatchNorm2d, NormComm
    from hybridpar.runtime.shard import Split
    from hybridpar.runtime.state import ShardInfo

    outer = state.grid
    if isinstance(m, nn.BatchNorm2d):  # follows the boundary layout
        if outer.g_size == 1 and outer.sample == 1:
            return None
        sizes = piece_sizes(m.num_features, outer.g_size)
        rng = tuple(ranges(sizes, [outer.g]))
        off, n = rng[0]
        new = DistBatchNorm2d(m, slice(off, off + n), NormComm(outer.replica_group, outer.comm_log, name),
                              bn_stats)
        vec = {"weight", "bias", "running_mean", "running_var"}
        state.shard_fns[name] = lambda: {a: ShardInfo((m.num_features,), (rng,)) for a in vec
                                         if getattr(new, a, None) is not None}
        return new
    if not isinstance(m, (nn.Conv2d, nn.Linear)):
        return None
    key = (lay.sample, lay.channel * lay.filter)
    grid = state.grids[key]
    off_default = grid is not outer
    if grid.g_size == 1 and not off_default:
        return None
    G = grid.g_size
    pos = grid.pos(lay.channel, lay.filter)
    fg, cg = grid.filter_group(lay.channel, lay.filter), grid.channel_group(lay.channel, lay.filter)
    w, b = m.weight.detach(), (m.bias.detach() if m.bias is not None else None)
    w_shape, b_shape = tuple(w.shape), (tuple(b.shape) if b is not None else None)
    out_sizes = piece_sizes(w.shape[0], G)
    rows = tuple(ranges(out_sizes, pos.out_piece_ids()))
    bias_rng = tuple(ranges(out_sizes, [pos.g]))
    if isinstance(m, nn.Conv2d):
        in_sizes = piece_sizes(w.shape[1], G)
        comm = ConvComm(pos, tuple(in_sizes), tuple(out_sizes), fg, cg, grid.comm_log, name)
        wb = weight_block(w, pos, in_sizes, out_sizes)
        bb = b[bias_rng[0][0]:bias_rng[0][0] + bias_rng[0][1]].clone() if b is not None else None
        boundary = (Split(outer.sample, outer.g_size), Split(grid.sample, G)) if off_default else None
        new = DistConv2d(wb, bb, conv_geometry(m), comm, boundary)
        cols = tuple(ranges(in_sizes, pos.in_piece_ids()))
        state.shard_fns[name] = lambda: {"weight": ShardInfo(w_shape, (rows, cols)),
                                         **({"bias": ShardInfo(b_shape, (bias_rng,))} if b_shape else {})}
        if off_default:
            state.param_grid.update({id(p): key for p in new.parameters()})
        return new
    new = DistLinear(w, b, pos, fg, cg, grid.sample_group, grid.comm_log, name)

    def linear_shards():
        cols = None if new.in_sizes is None else tuple(ranges(new.in_sizes, pos.in_piece_ids()))
        out = {"weight": ShardInfo(w_shape, (rows, cols))}
        if b_shape is not None:
            out["bias"] = ShardInfo(b_shape, (bias_rng,))
        return out

    state.shard_fns[name] = linear_shards
    return new


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, new)


# `hybridpar.runtime.parallelize` names this module once it is imported; keep it callable.
from hybridpar._callable import make_module_callable

make_module_callable(__name__, parallelize)
