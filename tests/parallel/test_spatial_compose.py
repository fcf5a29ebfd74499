"""Spatial x channel/filter in one layer (stationary-x/y/w on a spatial piece): `height=2,channel=2`
and `height=2,filter=2` train a tiny CNN equal to one process (fp64, pieces smaller than the halo,
uneven channel pieces), and each conv's bytes (halo + the channel/filter collectives) are the cost
model's (cost.layout_comm.spatial_conv_collectives) on every rank."""

from __future__ import annotations

import pytest

from hybridpar.train.launch import spawn

from ._spatial_compose_workers import compose_cases, tiny

STRATEGIES = ["height=2,channel=2", "height=2,filter=2"]


def _predicted(strategy: str, world: int) -> list[dict[str, int]]:
    from hybridpar.cost.layout_comm import spatial_conv_collectives
    from hybridpar.graph import trace
    from hybridpar.plans import parse_strategy

    model, x, _ = tiny()
    graph = trace(model, (x,))
    layout = parse_strategy(strategy).layout
    out = []
    for rank in range(world):
        per: dict[str, int] = {}
        for node in graph.nodes:
            if node.op not in ("conv2d", "maxpool"):
                continue
            grad = node.module != "0"  # the first conv's input (the model's) needs no gradient
            for op in spatial_conv_collectives(node, layout, rank=rank, input_grad=grad, dtype_bytes=8):
                if op.phase in ("fwd", "bwd") and op.bytes_:
                    key = f"{node.module}/{op.kind}/{op.phase}"
                    per[key] = per.get(key, 0) + op.bytes_
        out.append(per)
    return out


@pytest.mark.slow
def test_spatial_channel_filter_compose_exact_and_bytes():
    results = spawn(compose_cases, 4, STRATEGIES)
    for strategy, res in zip(STRATEGIES, results):
        predicted = _predicted(strategy, 4)
        for rank, r in enumerate(res["ranks"]):
            assert "SpatialDistConv" in r["kinds"], r["kinds"]
            assert r["out"] <= 1e-12 and r["weights"] <= 1e-12, (strategy, rank, r)
            sent = {k: v for k, v in r["sent"].items() if v and not k.startswith("output/")}  # the loss's gather
            assert sent == predicted[rank], (strategy, rank, sent, predicted[rank])
        assert any(k.endswith("/halo/fwd") for k in res["ranks"][0]["sent"])


def test_compose_refusals_before_start():
    """What still does not run: a plan whose layers differ under spatial splits (one line, before start)."""
    from hybridpar.errors import UserError
    from hybridpar.parallel.apply import as_layouts
    from hybridpar.plans import LayerLayout, Plan

    plan = Plan(model="m", world_size=4, batch=2, dp=4, default_layout=LayerLayout(height=2, channel=2),
                layers={"0": LayerLayout(height=2, filter=2)})
    with pytest.raises(UserError, match="different layouts with spatial"):
        as_layouts(plan)
    # the composition itself is no longer refused
    assert as_layouts("height=2,channel=2", 4).default.g_size == 2
