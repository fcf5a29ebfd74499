"""Spatial parallelism: a convolution or pooling on height/width/depth pieces with halo exchange
equals the whole op (forward, input and weight gradients), for strides, padding, dilation, groups,
odd sizes, uneven pieces and pieces smaller than the halo (4 gloo ranks, float64)."""

import itertools

import pytest

from hybridpar.layout.halo import Window, exchanges, halo_plan
from hybridpar.train.launch import spawn

from ._spatial_workers import cases

CASES = {
    "conv2d-height2-k3p1": dict(op="conv", size=(8, 6), k=3, p=1, dims=[2], grid=[2]),
    "conv2d-width2-stride2-odd": dict(op="conv", size=(9, 33), k=3, s=2, p=1, dims=[3], grid=[2]),
    "conv2d-h2w2-33x47-stride2": dict(op="conv", size=(33, 47), k=3, s=2, p=1, dims=[2, 3], grid=[2, 2]),
    "conv2d-dilated-h4": dict(op="conv", size=(13, 5), k=3, p=2, d=2, dims=[2], grid=[4]),
    "conv2d-pieces-smaller-than-halo": dict(op="conv", size=(5, 4), k=5, p=2, dims=[2], grid=[4]),
    "conv2d-more-ranks-than-output-rows": dict(op="conv", size=(4, 4), k=3, s=2, dims=[2], grid=[4]),
    "conv2d-grouped-7x7": dict(op="conv", size=(11, 9), k=7, p=3, cin=4, cout=6, groups=2, dims=[2, 3],
                               grid=[2, 2]),
    "conv1d-w4": dict(op="conv", size=(19,), k=4, s=3, p=1, dims=[2], grid=[4]),
    "conv3d-depth2-height2": dict(op="conv", size=(7, 6, 5), k=3, p=1, dims=[2, 3], grid=[2, 2]),
    "maxpool2d-h2w2-k3s2p1": dict(op="max", size=(13, 15), k=3, s=2, p=1, dims=[2, 3], grid=[2, 2]),
    "avgpool2d-h4-k2": dict(op="avg", size=(10, 6), k=2, dims=[2], grid=[4]),
    "maxpool3d-depth4-dilated": dict(op="max", size=(11, 4, 4), k=3, s=1, p=1, d=2, dims=[2], grid=[4]),
}


def _world(spec):
    n = 1
    for g in spec["grid"]:
        n *= g
    return n


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_spatial_ops_equal_whole_ops(world):
    names = [n for n, spec in CASES.items() if _world(spec) == world]
    got = spawn(cases, world, [CASES[n] for n in names])  # one world for all its cases: spawns are slow
    for name, (err, sent) in zip(names, got):
        assert err <= 1e-12, f"{name}: max error {err}"
        assert sent > 0, f"{name}: no halo exchanged"
        predicted = _predicted_bytes(CASES[name])
        assert sent == predicted, f"{name}: sent {sent} B, predicted {predicted}"
        assert sent == _cost_model_bytes(CASES[name]), name


def _cost_model_bytes(spec) -> int:
    """The same, from the cost model's rule on the traced layer (cost.layout_comm.halo_collectives)."""
    import torch
    from torch import nn

    from hybridpar.cost.layout_comm import halo_collectives
    from hybridpar.graph import trace
    from hybridpar.layout.halo import SPATIAL_DIMS
    from hybridpar.plans import LayerLayout

    nd = len(spec["size"])
    cin = spec.get("cin", 3)
    if spec["op"] == "conv":
        cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[nd]
        mod = cls(cin, spec.get("cout", 4), spec["k"], spec.get("s", 1), spec.get("p", 0), spec.get("d", 1),
                  spec.get("groups", 1))
    else:
        cls = getattr(nn, f"{'Max' if spec['op'] == 'max' else 'Avg'}Pool{nd}d")
        extra = {"dilation": spec.get("d", 1)} if spec["op"] == "max" else {}
        mod = cls(spec["k"], spec.get("s"), spec.get("p", 0), **extra)
    graph = trace(nn.Sequential(mod), (torch.randn(2, cin, *spec["size"]),))
    node = next(n for n in graph.nodes if n.op in ("conv2d", "conv", "maxpool", "avgpool"))
    names = SPATIAL_DIMS[3 - nd:]
    layout = LayerLayout(**{names[d - 2]: g for d, g in zip(spec["dims"], spec["grid"])})
    return sum(op.bytes_ for r in range(layout.size)
               for op in halo_collectives(node, layout, rank=r, dtype_bytes=8))


def _predicted_bytes(spec) -> int:
    """The halo bytes all ranks send in one forward and backward, from layout.halo alone (fp64)."""
    dims, grid = spec["dims"], spec["grid"]
    k, p, d = spec["k"], spec.get("p", 0), spec.get("d", 1)
    s = spec.get("s") or (k if spec["op"] != "conv" else 1)  # pooling's stride defaults to its kernel
    windows = {dim: Window(spec["size"][dim - 2], k, s, p, d) for dim in dims}
    total = 0
    for coord in itertools.product(*[range(n) for n in grid]):
        lead = 2 * spec.get("cin", 3)  # batch 2 x input channels
        for _, _, fwd, bwd in exchanges(tuple(spec["size"]), windows, dict(zip(dims, grid)), dict(zip(dims, coord)),
                                        lead):
            total += (fwd + bwd) * 8
    return total


def test_halo_plan_rows():
    # 3x3 conv, padding 1, 8 rows over 2 ranks: each sends its neighbour one row
    plan = halo_plan(Window(8, 3, 1, 1), 2)
    assert plan.sends[0][1] == (3, 4) and plan.sends[1][0] == (4, 5)
    assert plan.pad == ((1, 0), (0, 1))
    # 5 rows over 4 ranks (pieces 2,2,1,0) with a 5-wide kernel: pieces smaller than the halo; rank 1's
    # window [0, 6) takes rank 0's whole piece and rank 2's, rank 3 has no output and needs nothing
    plan = halo_plan(Window(5, 5, 1, 2), 4)
    assert plan.sends[0][1] == (0, 2) and plan.sends[2][1] == (4, 5) and plan.rows_received(1) == 3
    assert plan.window[3] == (0, 0) and plan.pad[2] == (0, 2)
    # no halo for a 1x1 conv
    plan = halo_plan(Window(8, 1), 2)
    assert plan.rows_sent(0) == plan.rows_sent(1) == 0
