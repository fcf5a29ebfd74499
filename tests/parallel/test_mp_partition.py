"""Partitioning a traced model over MP devices (no processes): device rules, crossings, owners."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridpar.errors import UserError
from hybridpar.graph.models import load_model
from hybridpar.parallel.pipeline import check_mp_plan, partition_module
from hybridpar.parallel.pipeline.executor import crossings, meta_copy, meta_values
from hybridpar.plans import Plan


def test_module_placement_and_functional_nodes_follow():
    m = load_model("inception_mini").module
    part = partition_module(m, {"block1.b3": 1, "fc": 1}, 2)
    dev = part.device_of
    assert dev["block1_b3_0"] == dev["block1_b3_3"] == 1  # ancestor "block1.b3" places its children
    assert dev["block1_b1_0"] == 0 and dev["stem_0"] == 0  # unplaced: first input's device, else 0
    assert dev["cat"] == dev["block1_b1_1"] == 0  # the concat follows its first input
    assert dev["x"] is None  # inputs are on every device
    assert part.output_device == 1
    # block1.b3's weights live on device 1, everything else on 0
    assert part.owner_of_key["block1.b3.0.weight"] == 1 and part.owner_of_key["fc.bias"] == 1
    assert part.owner_of_key["block1.b1.0.weight"] == 0


def test_back_and_forth_crossings_in_global_order():
    m = load_model("lstm2").module
    part = partition_module(m, {"embed": 1, "lstm1": 0, "lstm2": 1, "fc": 0}, 2)
    hops = [(t.node, t.src, t.dst) for t in part.transfers]
    assert hops == [("embed", 1, 0), ("getitem", 0, 1), ("getitem_4", 1, 0)]
    assert [t.index for t in part.transfers] == [0, 1, 2]
    for t in part.transfers:
        assert t.send_pos < t.recv_pos  # lazy receive: just before the first local use
    # each device sees its events in the same relative order as the global one
    for d in (0, 1):
        idx = [t.index for _, _, t in part.events_of(d)]
        assert idx == sorted(idx)


def test_ordered_mode_receives_at_the_producer():
    m = load_model("lstm2").module
    part = partition_module(m, {"lstm2": 1}, 2, lazy_recv=False)
    assert all(t.recv_pos == t.send_pos for t in part.transfers)


def test_crossing_shapes_and_gradients_from_meta_run():
    m = load_model("lstm2").module
    part = partition_module(m, {"lstm2": 1, "fc": 1}, 2)
    values = meta_values(part, meta_copy(m).train(), (torch.randint(0, 64, (4, 16)),))
    (c,) = crossings(part, values).values()
    (t,) = c.tensor_leaves
    assert tuple(t.shape) == (4, 16, 64) and c.diff == (True,)


def test_meta_copy_has_no_storage_and_leaves_module_alone():
    m = load_model("inception_mini").module
    meta = meta_copy(m)
    assert all(p.device.type == "meta" for p in meta.parameters())
    assert all(p.device.type == "cpu" for p in m.parameters())


@pytest.mark.parametrize("placement, msg", [
    ({"fc": 2}, "outside devices"),
    ({"nonexistent": 1}, "neither a module nor an fx node"),
])
def test_bad_placements_are_user_errors(placement, msg):
    with pytest.raises(UserError, match=msg):
        partition_module(load_model("inception_mini").module, placement, 2)


class _Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(self.b(self.a(x)))


def test_weights_used_on_two_devices_are_rejected():
    with pytest.raises(UserError, match="on devices"):
        partition_module(_Shared(), {"a": 0, "b": 1, "a_1": 1}, 2)


def test_untraceable_model_is_a_user_error():
    class Dyn(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    with pytest.raises(UserError, match="torch.fx"):
        partition_module(Dyn(), {}, 2)


@pytest.mark.parametrize("name", ["inception_mini", "lstm2"])
def test_zoo_models_run_and_train(name):
    lm = load_model(name, batch=2)
    out = lm.module(*lm.example_inputs)
    assert out.shape == (2, 10)
    out.sum().backward()
    assert all(p.grad is not None for p in lm.module.parameters())


def test_check_mp_plan_before_spawning():
    plan = Plan(model="small_cnn", world_size=4, batch=8, dp=2, mp=2, default_layout={"sample": 2},
                placement={"16": 1})
    check_mp_plan(load_model("small_cnn").module, plan, 8)
    with pytest.raises(UserError, match="batch-norm"):
        check_mp_plan(load_model("small_cnn").module, plan, 9)
    bad = plan.model_copy(update={"placement": {"conv9": 1}})
    with pytest.raises(UserError, match="neither a module"):
        check_mp_plan(load_model("small_cnn").module, bad, 8)
    mixed = Plan(model="small_cnn", world_size=4, batch=8, dp=2, mp=2, default_layout={"channel": 2})
    with pytest.raises(UserError, match="channels/filters"):
        check_mp_plan(load_model("small_cnn").module, mixed, 8)


def test_gradient_buckets_reverse_order_and_size():
    """The MP engine's gradient sync is the package's one GradSync (hybridpar.parallel.comm.grad_sync):
    buckets in the order backward makes gradients ready, by the bucket rule the planner prices."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hybridpar.cost.layout_comm import bucket_schedule
    from hybridpar.parallel.comm.grad_sync import GradSync
    from hybridpar.parallel.comm.log import CommLog
    from hybridpar.parallel.mesh import Group

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        group = Group((0, 1), dist.group.WORLD, 0)
        for bucket_bytes, want in ((1000, [1200, 1000, 400]), (1 << 20, [2600])):
            params = [nn.Parameter(torch.zeros(n)) for n in (100, 200, 50, 300)]  # 400, 800, 200, 1200 bytes
            sync = GradSync(params, lambda _p, g=group: g, {}, CommLog(), bucket_bytes=bucket_bytes)
            sum(p.sum() for p in params).backward()
            assert [b for _, b in sync.buckets] == want
            ready = [(group.ranks, p.numel() * 4) for p in reversed(params)]  # backward: last first
            assert [b for _, b, _ in bucket_schedule(ready, bucket_bytes)] == want
    finally:
        dist.destroy_process_group()


class _Chain3(nn.Module):
    """x -> +1 -> +1 -> +1 -> sum, an nn.Identity (a leaf, so a hook sees the value) after each add;
    the adds save nothing for backward, so eager frees each value once the next add has read it."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Identity(), nn.Identity(), nn.Identity()

    def forward(self, x):
        return self.c(self.b(self.a(x + 1) + 1) + 1).sum()


def test_the_executor_forgets_a_value_after_its_last_use_as_eager_does():
    import weakref

    from hybridpar.parallel.comm.log import CommLog
    from hybridpar.parallel.pipeline.executor import run_forward
    from hybridpar.parallel.pipeline.p2p import Link

    model = _Chain3()
    part = partition_module(_Chain3(), {}, 1)
    refs, alive_at_c = [], []
    model.a.register_forward_hook(lambda m, i, o: refs.append(weakref.ref(o)))
    model.c.register_forward_hook(lambda m, i, o: alive_at_c.append(refs[-1]() is not None))
    part.gm.a.register_forward_hook(lambda m, i, o: refs.append(weakref.ref(o)))
    part.gm.c.register_forward_hook(lambda m, i, o: alive_at_c.append(refs[-1]() is not None))
    x = torch.randn(4, 3, requires_grad=True)
    expected = model(x)
    assert alive_at_c == [False]  # eager: a's output is gone by the time c runs
    refs.clear()
    alive_at_c.clear()
    link = Link(rank_of_device=lambda d: d, log=CommLog(), prepost=True)
    out, _ = run_forward(part, 0, link, (x,), {}, 0, torch.device("cpu"))
    assert alive_at_c == [False], "the executor held a's output past its last use"
    assert torch.equal(out, expected)
    drops = part.drops_of(0)
    dropped = {n.name for names in drops.values() for n in names}
    assert part.output_node not in dropped and "x" not in dropped
