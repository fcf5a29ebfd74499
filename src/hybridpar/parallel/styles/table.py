"""One builder per parallel layer kind, and the type -> builder table parallel_model applies by
module name (torchtitan's name -> parallel style dict, keyed here by what a module is).

A builder gets the module's name, the module, its layout and the ParallelState; it returns the
distributed replacement (or None: the module stays as it is) and records, in `state.shard_fns`,
where this rank's parameter pieces sit in the undistributed tensors (for full_state_dict)."""

from __future__ import annotations

from torch import nn

from hybridpar.errors import UserError
from hybridpar.layout import LayerLayout, Split, piece_sizes, ranges


def batchnorm_style(name: str, m: nn.Module, lay: LayerLayout, state):
    """Batch norm follows the boundary layout: this rank's channel piece, global statistics."""
    from hybridpar.parallel.state import ShardInfo
    from hybridpar.parallel.styles.norm import DistBatchNorm, NormComm

    assert isinstance(m, nn.modules.batchnorm._BatchNorm)  # style_for's choice
    outer = state.grid
    if outer.g_size == 1 and outer.sample == 1 and outer.spatial == 1:
        return None
    features = m.num_features
    rng = tuple(ranges(piece_sizes(features, outer.g_size), [outer.g]))
    off, n = rng[0]
    # statistics over every rank holding this channel piece: the sample replicas and, with spatial
    # splits, their spatial pieces (the grid's stats group)
    new = DistBatchNorm(m, slice(off, off + n), NormComm(outer.stats_group, outer.comm_log, name), state.bn_stats)
    if outer.spatial > 1:
        new.rows_comm = NormComm(outer.replica_group, outer.comm_log, name)
    vec = {"weight", "bias", "running_mean", "running_var"}
    state.shard_fns[name] = lambda: {a: ShardInfo((features,), (rng,)) for a in vec
                                     if getattr(new, a, None) is not None}
    return new


def _weight_pieces(m: nn.Conv2d | nn.Linear, lay: LayerLayout, state):
    key = (lay.sample, lay.g_size)
    grid = state.grids[key]
    pos = grid.pos(lay.channel, lay.filter)
    w, b = m.weight.detach(), (m.bias.detach() if m.bias is not None else None)
    out_sizes = piece_sizes(w.shape[0], grid.g_size)
    return key, grid, pos, w, b, out_sizes


def conv_style(name: str, m: nn.Conv2d, lay: LayerLayout, state):
    """Conv2d on a P_C x P_F grid (stationary-x/y/w); another (S, G) than the model's default
    redistributes its input in and its output back."""
    from hybridpar.parallel.state import ShardInfo
    from hybridpar.parallel.styles.conv import ConvComm, DistConv2d, conv_geometry, weight_block

    key, grid, pos, w, b, out_sizes = _weight_pieces(m, lay, state)
    outer = state.grid
    off_default = grid is not outer
    if grid.g_size == 1 and not off_default:
        return None
    G = grid.g_size
    in_sizes = piece_sizes(w.shape[1], G)
    comm = ConvComm(pos, tuple(in_sizes), tuple(out_sizes), grid.filter_group(lay.channel, lay.filter),
                    grid.channel_group(lay.channel, lay.filter), grid.comm_log, name)
    rows, cols = tuple(ranges(out_sizes, pos.out_piece_ids())), tuple(ranges(in_sizes, pos.in_piece_ids()))
    bias_rng = tuple(ranges(out_sizes, [pos.g]))
    bb = b[bias_rng[0][0]:bias_rng[0][0] + bias_rng[0][1]].clone() if b is not None else None
    boundary = (Split(outer.sample, outer.g_size), Split(grid.sample, G)) if off_default else None
    assert isinstance(m, nn.Conv2d)  # style_for's choice
    new = DistConv2d(weight_block(w, pos, in_sizes, out_sizes), bb, conv_geometry(m), comm, boundary)
    w_shape, b_shape = tuple(w.shape), (tuple(b.shape) if b is not None else None)
    state.shard_fns[name] = lambda: {"weight": ShardInfo(w_shape, (rows, cols)),
                                     **({"bias": ShardInfo(b_shape, (bias_rng,))} if b_shape else {})}
    if off_default:
        state.param_grid.update({id(p): key for p in new.parameters()})
    return new


def linear_style(name: str, m: nn.Linear, lay: LayerLayout, state):
    """Linear as a 1x1 distributed convolution over its last dim (channel: row-, filter: column-parallel)."""
    from hybridpar.parallel.state import ShardInfo
    from hybridpar.parallel.styles.conv import DistLinear

    _key, grid, pos, w, b, out_sizes = _weight_pieces(m, lay, state)
    if grid is not state.grid:
        raise UserError(f"{name}: a Linear layer must use the default layout")
    if grid.g_size == 1:
        return None
    new = DistLinear(w, b, pos, grid.filter_group(lay.channel, lay.filter),
                     grid.channel_group(lay.channel, lay.filter), grid.comm_log, name)
    rows, cols = tuple(ranges(out_sizes, pos.out_piece_ids())), tuple(ranges(new.in_sizes, pos.in_piece_ids()))
    bias_rng = tuple(ranges(out_sizes, [pos.g]))
    w_shape, b_shape = tuple(w.shape), (tuple(b.shape) if b is not None else None)
    state.shard_fns[name] = lambda: {"weight": ShardInfo(w_shape, (rows, cols)),
                                     **({"bias": ShardInfo(b_shape, (bias_rng,))} if b_shape else {})}
    return new


def splits_as_conv(m: nn.Module) -> bool:
    """A Conv2d our distributed convolution computes exactly (plain type: a subclass may override
    forward, e.g. weight standardisation, and runs through DTensor's rules instead). The rule is
    the cost model's too (hybridpar.layout.runs)."""
    from hybridpar.layout.runs import runs_distributed

    return isinstance(m, nn.Conv2d) and runs_distributed(
        "conv2d", f"{type(m).__module__}.{type(m).__qualname__}", m.groups, m.padding_mode)


# Exact types: a subclass may override forward (weight standardisation, ...) and then runs through
# DTensor with replicated parameters and hybridpar.parallel.dtensor.rules instead.
PARALLEL_STYLES = {
    nn.Conv2d: conv_style,
    nn.Linear: linear_style,
    nn.BatchNorm1d: batchnorm_style,
    nn.BatchNorm2d: batchnorm_style,
    nn.BatchNorm3d: batchnorm_style,
}


def style_for(m: nn.Module, lay: LayerLayout | None = None):
    """The builder for `m`, or None (a grouped/depthwise conv or another padding mode: not ours).
    Under a layout with spatial splits: convolutions, transposed convolutions, pooling and upsampling
    get hybridpar.parallel.styles.spatial_layers' wrappers; batch norm its global statistics."""
    if lay is not None and lay.spatial > 1:
        from hybridpar.parallel.styles.spatial_layers import spatial_style, spatial_wraps

        if spatial_wraps(m):
            return spatial_style
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm):
            return batchnorm_style
        return None
    if isinstance(m, nn.Conv2d) and not splits_as_conv(m):
        return None
    style = PARALLEL_STYLES.get(type(m))
    if style is None and isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm):
        return batchnorm_style  # subclasses of batch norm keep batch norm's forward contract
    return style
