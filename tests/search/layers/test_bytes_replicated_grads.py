"""Replicated (DTensor) parameters under a sample x channel/filter layout: an embedding, attention's
projections and norms inside a channel/filter model. Their gradients are Partial over both mesh
dims (each rank summed its own samples and its own share of the rows); the runtime sums each over
the whole mesh in one allreduce (before: one over `sample`, then another over `channel_filter`, the
bytes twice: 15,032 allreduce bytes sent against 10,296 planned for the model below at
sample=2,filter=2, batch 8). The runtime's bytes are read from the dry run (meta tensors on a fake
world, this process: what one rank of `hybridpar train` logs)."""

from __future__ import annotations

import pytest
from tests.search.layers import tiny_encoder


def factory():
    return tiny_encoder.factory(batch=8)


def _sent(strategy: str, world: int) -> dict[str, int]:
    """Bytes per kind rank 0 logs in one step (sample_shard inputs, as `hybridpar train` runs)."""
    from hybridpar.parallel.check import dry_run

    model, inputs = factory()
    return dry_run(model, strategy, inputs, world_size=world).our_bytes


@pytest.mark.parametrize("strategy", ["sample=2,filter=2", "channel=2,filter=2"])
def test_planned_allreduce_bytes_equal_the_runtimes(strategy):
    from hybridpar.search.layers.planner import plan_model

    planned = plan_model(factory(), "localhost", gpus=4, batch=8, strategy=strategy)
    assert planned.prediction.comm_bytes.get("allreduce", 0) == _sent(strategy, 4).get("allreduce", 0)


def test_replicated_gradients_priced_as_one_allreduce_over_the_mesh():
    """The planner prices what GradSync sends for them: one flattened allreduce over all S x G ranks
    (before: one per node over the S ranks of its shard group, 7 collectives here)."""
    from hybridpar.search.layers.planner import planned_grad_buckets

    priced = planned_grad_buckets(factory(), "sample=2,filter=2", gpus=4, batch=8)
    replicated = 4 * (50 * 16 + (48 * 16 + 48) + (16 * 16 + 16) + 4 * 16)  # emb, attention, 2 norms
    assert [(s, g, b) for s, g, b in priced if s * g == 4 and g == 1] == [(4, 1, replicated)]
