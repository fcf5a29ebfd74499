"""Every parameter a conv/linear node holds is in its gradient allreduce under every layout
(hybridpar.cost.layout_comm._matmul_like): the sharded weight and bias, and any other parameter the
tracer gave the node (a free parameter no op reads goes to its module's first node), which no layout
splits."""

from __future__ import annotations

import pytest

from hybridpar.cost.layout_comm import grad_ready_bytes, layer_collectives
from hybridpar.graph.types import Node
from hybridpar.layout import GridPos, piece_sizes
from hybridpar.plans import LayerLayout

B = 4  # fp32


def _conv(extra: bool, bias: bool = True) -> Node:
    params = [("blk.conv.weight", (12, 6, 3, 3))] + ([("blk.conv.bias", (12,))] if bias else [])
    if extra:
        params += [("blk.gain", (5,)), ("blk.table", (2, 3))]  # 11 free elements
    return Node("conv", "conv2d", inputs=("x",), in_shapes=((8, 6, 10, 10),), out_shape=(8, 12, 10, 10),
                param_shapes=tuple(params))


def _linear(extra: bool) -> Node:
    params = [("fc.weight", (10, 20)), ("fc.bias", (10,))] + ([("scale", (7,))] if extra else [])
    return Node("fc", "linear", inputs=("x",), in_shapes=((8, 20),), out_shape=(8, 10), param_shapes=tuple(params))


def _grad(node: Node, lay: LayerLayout, position: int = 0) -> int:
    ops = [op for op in layer_collectives(node, lay, position=position) if op.phase == "grad"]
    assert all(op.group == "replica" and op.group_size == lay.sample for op in ops)
    return sum(op.bytes_ for op in ops)


@pytest.mark.parametrize("channel,filter_", [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (4, 1), (3, 1)])
@pytest.mark.parametrize("make,free", [(_conv, 11), (_linear, 7)])
def test_free_parameters_count_whole_under_every_layout(make, free, channel, filter_):
    lay = LayerLayout(sample=2, channel=channel, filter=filter_)
    g = channel * filter_
    plain, with_free = make(False), make(True)
    for pos in range(g):
        # the free parameters are whole on every rank: exactly their bytes on top of the shard in a
        # sample-only layout; under channel/filter they are DTensors no op reads: no gradient, none sent
        assert _grad(with_free, lay, pos) - _grad(plain, lay, pos) == (free * B if g == 1 else 0)
        assert sum(grad_ready_bytes(with_free, lay, position=pos)) == _grad(with_free, lay, pos)
    # the shard alone is the weight block and bias piece the runtime holds (GridPos's pieces)
    w = dict(plain.param_shapes)[next(k for k, _ in plain.param_shapes if k.endswith("weight"))]
    k_sp = w[2] * w[3] if len(w) == 4 else 1
    for pos in range(g):
        gp = GridPos(channel, filter_, pos)
        ins, outs = piece_sizes(w[1], g), piece_sizes(w[0], g)
        rows, cols = sum(outs[k] for k in gp.out_piece_ids()), sum(ins[k] for k in gp.in_piece_ids())
        want = rows * cols * k_sp + (outs[pos] if g > 1 else w[0])
        assert _grad(plain, lay, pos) == want * B


def test_every_parameter_summed_over_shards_equals_the_model():
    """Over one sample group's G ranks, the sharded weight and bias add up to the whole layer once;
    the free parameters (no op reads them: no gradient under channel/filter layouts) are not sent."""
    node = _conv(True)
    total = 12 * 6 * 9 + 12
    for channel, filter_ in [(2, 1), (1, 2), (2, 2), (1, 3)]:
        lay = LayerLayout(sample=2, channel=channel, filter=filter_)
        g = channel * filter_
        sent = sum(_grad(node, lay, pos) for pos in range(g))
        assert sent == total * B, (channel, filter_)


def test_a_weight_not_named_weight_is_whole():
    """F.conv2d(x, self.kernel): the runtime splits only nn.Conv2d/nn.Linear modules, so a kernel
    held under another name stays whole on every rank (counted once, not as a shard plus whole)."""
    node = Node("c", "conv2d", inputs=("x",), in_shapes=((8, 6, 10, 10),), out_shape=(8, 12, 10, 10),
                param_shapes=(("kernel", (12, 6, 3, 3)),))
    assert _grad(node, LayerLayout(sample=2, channel=2, filter=2)) == 12 * 6 * 9 * B


def test_pieces_summed_in_closed_form_equal_the_piece_list():
    from hybridpar.cost.layout_comm import _pieces_sum

    for n in (0, 1, 3, 10, 17, 64, 100):
        for p in (1, 2, 3, 4, 7, 16, 33):
            sizes = piece_sizes(n, p)
            for step in {1, 2, 3, p}:
                for start in range(min(p, step + 3)):
                    for count in range(0, (p - 1 - start) // step + 2):
                        want = sum(sizes[start + i * step] for i in range(count))
                        assert _pieces_sum(n, p, start, step, count) == want, (n, p, start, step, count)
