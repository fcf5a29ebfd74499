"""`parallelize(module, layout)`: replace a CNN's standard layers in place, keyed by module name (as
torch.distributed.tensor.parallel.parallelize_module does), so no trace of forward is needed.

Activations between layers are split on samples over the S sample groups and on channels into
G = P_C*P_F pieces inside a sample group; every conv/linear layout (channel, filter) with
channel*filter = G keeps that boundary layout, so per-layer layouts that share the sample degree mix
freely without redistribution. Pointwise ops, pooling, residual adds, global average pooling and
flatten act on the local piece unchanged. Layouts whose sample degree differs between layers are
rejected before training (they would need a redistribution this runtime does not do).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from hybridpar.errors import UserError
from hybridpar.plan import LayerLayout, Plan, parse_strategy
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
    """(S, G) shared by every layer; mixed sample degrees are rejected."""
    samples = {lay.sample for lay in layouts.all}
    if len(samples) > 1:
        raise UserError(f"layers use different sample degrees {sorted(samples)}: per-layer layouts must "
                        "share the sample degree (redistribution between them is not supported)")
    d = layouts.default
    return d.sample, d.channel * d.filter


def check_parallelizable(module: nn.Module, layouts: Layouts, batch: int | None = None) -> None:
    """Everything that would make parallelize fail, raised as a UserError before any process starts."""
    s, g = grid_shape(layouts)
    if batch is not None and batch % s:
        raise UserError(f"global batch {batch} is not divisible by the sample degree {s}")
    for name in layouts.per_module:
        try:
            module.get_submodule(name)
        except AttributeError:
            raise UserError(f"plan names module {name!r}, which the model does not have") from None
    if g == 1:
        return
    for name, m in module.named_modules():
        if isinstance(m, nn.Conv2d):
            if m.groups != 1:
                raise UserError(f"{name}: grouped/depthwise convolution (groups={m.groups}) cannot be "
                                "channel/filter-split; use a sample-only layout")
            if m.padding_mode != "zeros":
                raise UserError(f"{name}: padding_mode={m.padding_mode!r} is not supported distributed")
        elif isinstance(m, (nn.Linear, nn.BatchNorm2d, *LOCAL_OK)):
            continue
        elif any(True for _ in m.parameters(recurse=False)):
            raise UserError(f"{name}: {type(m).__name__} has parameters and no channel/filter-parallel "
                            "form; use a sample-only layout")


@dataclass
class ParallelState:
    """What parallelize did: the grid, and where each local tensor sits in the undistributed one."""

    grid: object
    layouts: Layouts
    bn_stats: str
    shard_fns: dict[str, object] = field(default_factory=dict)  # module name -> () -> {attr: ShardInfo}

    def shards(self) -> dict:
        out = {}
        for mname, fn in self.shard_fns.items():
            for attr, info in fn().items():
                out[f"{mname}.{attr}" if mname else attr] = info
        return out


def parallelize(module: nn.Module, spec: Plan | LayerLayout | str, *, grid=None, bn_stats: str = "global",
                comm_log: CommLog | None = None) -> nn.Module:
    """Replace `module`'s Conv2d, Linear and BatchNorm2d layers in place by their distributed forms for
    this rank (torch.distributed must be initialised). Returns the module, with `.hybridpar` set to a
    ParallelState. Collective: every rank calls it with the same arguments."""
    import torch.distributed as dist

    from hybridpar.runtime.grid import build_grid

    layouts = as_layouts(spec, dist.get_world_size())
    check_parallelizable(module, layouts)
    s, g = grid_shape(layouts)
    facts = {(lay.channel, lay.filter) for lay in layouts.all}
    if grid is None:
        grid = build_grid(s, g, facts, comm_log)
    state = ParallelState(grid, layouts, bn_stats)
    for name, m in list(module.named_modules()):
        new = _replacement(name, m, layouts.of(name), grid, bn_stats, state)
        if new is not None:
            _set_submodule(module, name, new)
    module.hybridpar = state
    return module


def _replacement(name, m, lay: LayerLayout, grid, bn_stats, state: ParallelState):
    from hybridpar.runtime.conv import ConvComm, DistConv2d, DistLinear, conv_geometry, weight_block
    from hybridpar.runtime.norm import DistBatchNorm2d, NormComm
    from hybridpar.runtime.state import ShardInfo

    G = grid.g_size
    if isinstance(m, nn.BatchNorm2d):
        if G == 1 and grid.sample == 1:
            return None
        sizes = piece_sizes(m.num_features, G)
        rng = tuple(ranges(sizes, [grid.g]))
        off, n = rng[0]
        new = DistBatchNorm2d(m, slice(off, off + n), NormComm(grid.replica_group, grid.comm_log, name),
                              bn_stats)
        vec = {"weight", "bias", "running_mean", "running_var"}
        state.shard_fns[name] = lambda: {a: ShardInfo((m.num_features,), (rng,)) for a in vec
                                         if getattr(new, a, None) is not None}
        return new
    if G == 1 or not isinstance(m, (nn.Conv2d, nn.Linear)):
        return None
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
        new = DistConv2d(wb, bb, conv_geometry(m), comm)
        cols = tuple(ranges(in_sizes, pos.in_piece_ids()))
        state.shard_fns[name] = lambda: {"weight": ShardInfo(w_shape, (rows, cols)),
                                         **({"bias": ShardInfo(b_shape, (bias_rng,))} if b_shape else {})}
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
