"""The gradient-bucket rule the runtime runs and the planner prices (hybridpar.cost.layout_comm)."""

from __future__ import annotations

from hybridpar.cost.layout_comm import BUCKET_BYTES, bucket_schedule


def test_bucket_launches_when_full_and_the_rest_at_the_end_in_opening_order():
    ready = [("a", 3), ("b", 1), ("a", 2), ("a", 4), ("b", 5), ("a", 1)]
    # a: 3+2 = 5 >= 5 launches after index 2; a reopens with 4 (after b opened), b: 1+5 = 6 at 4
    assert bucket_schedule(ready, 5) == [("a", 5, 2), ("b", 6, 4), ("a", 5, 5)]
    assert bucket_schedule([("a", 1), ("b", 1)], 5) == [("a", 1, 2), ("b", 1, 2)]
    assert bucket_schedule([], 5) == []
    assert BUCKET_BYTES == 4 << 20


def test_planner_prices_buckets_between_hidden_and_flat():
    from hybridpar.search.layers.planner import plan_model

    kw = dict(cluster="lassen", gpus=16, batch=512, strategy="sample=16")
    flat = plan_model("resnet50", grad_sync="flat", **kw).prediction
    buckets = plan_model("resnet50", grad_sync="buckets", **kw).prediction
    assert buckets.compute_s < buckets.step_time_s < flat.step_time_s
    assert buckets.comm_bytes == flat.comm_bytes  # the same bytes, only their timing differs
