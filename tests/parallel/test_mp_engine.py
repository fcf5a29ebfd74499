"""MP and hybrid DP x MP training on real gloo ranks equals single-process SGD.

One spawned world per size runs every case of that size (spawning costs more than a case)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybridpar.graph.models import load_model
from hybridpar.parallel.pipeline import MPEngine
from hybridpar.plans import Plan
from hybridpar.search.placer import place_model
from hybridpar.search.placer.module_placement import placement_from_outcome, predicted_p2p_bytes
from hybridpar.train.engine import task_loss_sum
from hybridpar.train.launch import spawn

STEPS, BATCH, LR, MOMENTUM = 5, 8, 0.05, 0.9

# Placements that cross back and forth (0 -> 1 -> 0 -> 1 ...), not contiguous stages.
INCEPTION_2 = {"block1.b3": 1, "block1.bp": 1, "block2.b1": 1, "block2.b5": 1, "fc": 1}
INCEPTION_4 = {"stem": 1, "block1.b1": 2, "block1.b3": 3, "block1.b5": 0, "pool": 1, "block2.b3": 2,
               "block2.bp": 3, "fc": 2}
LSTM_2 = {"embed": 1, "lstm1": 0, "lstm2": 1, "fc": 0}
LSTM_4 = {"embed": 1, "lstm1": 2, "lstm2": 3, "fc": 0}
# small_cnn is a Sequential (conv, bn, relu) x 2, pool, (conv, bn, relu) x 2, pool, gap, flatten, fc
SMALL_CNN_2 = {"3": 1, "4": 1, "5": 1, "10": 1, "11": 1, "16": 1}

# (model, dp, mp, placement, engine options)
CASES_2 = [
    ("inception_mini", 1, 2, INCEPTION_2, {}),
    ("inception_mini", 1, 2, INCEPTION_2, {"ordered_p2p": True}),
    ("lstm2", 1, 2, LSTM_2, {}),
    ("lstm2", 1, 2, {}, {}),  # all on device 0 (the placer's choice on localhost): device 1 idles
]
CASES_4 = [
    ("inception_mini", 1, 4, INCEPTION_4, {}),
    ("inception_mini", 2, 2, INCEPTION_2, {"grad_bucket_bytes": 1024}),
    ("inception_mini", 2, 2, INCEPTION_2, {"micro_batches": 2}),
    ("lstm2", 1, 4, LSTM_4, {"micro_batches": 3}),
    ("lstm2", 2, 2, LSTM_2, {"ordered_p2p": True, "overlap_grad_sync": False}),
    ("small_cnn", 2, 2, SMALL_CNN_2, {}),  # batch norm: statistics over both replicas
]


def _data(kind: str, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = (lambda: torch.randint(0, 64, (BATCH, 16), generator=g)) if kind == "seq" else \
        (lambda: torch.randn(BATCH, 3, 16, 16, generator=g))
    return [(x(), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(STEPS)]


def _serial(model: str, init: dict, data) -> tuple[dict, list[float]]:
    m = load_model(model).module
    m.load_state_dict(init)
    opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for x, y in data:
        loss = task_loss_sum(m(x), y) / y.numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return m.state_dict(), losses


def _run_cases(cases, init_dir: str) -> list[dict]:
    """In every rank: for each case, load the saved initial weights, train, gather (rank 0)."""
    out = []
    for i, (model, dp, mp, placement, opts) in enumerate(cases):
        torch.manual_seed(1000 + dist.get_rank())  # different init everywhere: --init-from must win
        loaded = load_model(model)
        loaded.module.load_state_dict(torch.load(Path(init_dir) / f"{i}.pt", weights_only=True))
        plan = Plan(model=model, world_size=dp * mp, batch=BATCH, dp=dp, mp=mp, placement=placement,
                    default_layout={"sample": dp})
        eng = MPEngine(loaded.module, plan, loss_fn=task_loss_sum, **opts)
        opt = torch.optim.SGD(eng.parameters(), lr=LR, momentum=MOMENTUM)
        losses = []
        sends: list[tuple[int, object]] = []
        real = dist.isend

        def spy(tensor, dst=None, group=None, tag=0, sends=sends, real=real, **kw):
            sends.append((dst, group))
            return real(tensor, dst, group=group, tag=tag, **kw)

        dist.isend = spy  # the runtime calls torch.distributed.isend through the module
        try:
            for x, y in _data(loaded.kind):
                losses.append(eng.train_step(*eng.local_batch(x, y)))
                opt.step()
                opt.zero_grad()
        finally:
            dist.isend = real
        dirs = eng.link.directions
        names = {} if dirs is None else {id(dirs[0]): "up", id(dirs[1]): "down"}
        # (which way each send went, the group it rode): a group per direction on gloo's pre-posted path
        routes = sorted({("up" if dst % mp > eng.layout.device else "down", names.get(id(g), "default"))
                         for dst, g in sends})
        dir_ranks = None if dirs is None else [dist.get_process_group_ranks(g) for g in dirs]
        kinds = eng.comm_log.step_bytes_by_kind()
        sent = [None] * dist.get_world_size()
        dist.all_gather_object(sent, kinds.get("send", 0))
        bytes_ = [None] * dist.get_world_size()
        dist.all_gather_object(bytes_, eng.param_bytes())
        state = eng.full_state_dict()
        sync = eng._grad_sync
        every_route: list = [None] * dist.get_world_size()
        dist.all_gather_object(every_route, (routes, dir_ranks, eng.layout.stage_ranks()))
        out.append({"overlapped": None if sync is None else sync.started_in_backward, "state": state,
                    "losses": losses, "comm": kinds, "param_bytes": bytes_, "sent_per_rank": sent,
                    "routes": every_route})
    return out


def _check(cases, results, inits):
    for (model, dp, mp, placement, opts), res, init in zip(cases, results, inits):
        ref, ref_losses = _serial(model, init, _data(load_model(model).kind))
        label = f"{model} dp={dp} mp={mp} {opts}"
        assert res["state"].keys() == ref.keys(), label
        for k in ref:
            got, want = res["state"][k].double(), ref[k].double()
            err = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
            assert err <= 1e-4, f"{label}: {k} rel err {err:.2e}"
        assert res["losses"] == pytest.approx(ref_losses, rel=1e-4), label
        total = sum(p.numel() * p.element_size() for p in load_model(model).module.parameters())
        per_replica = res["param_bytes"][:mp]
        assert sum(per_replica) == total, label  # each weight on exactly one device of a replica
        if opts.get("grad_bucket_bytes"):  # small buckets: allreduces start while backward runs
            assert res["overlapped"] > 0, label
        if opts.get("overlap_grad_sync") is False:
            assert res["overlapped"] == 0, label
        if placement:
            assert res["comm"].get("send", 0) > 0, f"{label}: no activation crossed devices"
            assert max(per_replica) < total, label
            _check_routes(res["routes"], bool(opts.get("ordered_p2p")), label)


def _check_routes(per_rank, ordered: bool, label: str) -> None:
    """gloo's pre-posted path sends to a higher device on one group and to a lower one on another,
    both over the replica's ranks (pipeline.p2p.Link: gloo's pair lock); the ordered path (NCCL's)
    keeps the default group."""
    ways = set()
    for routes, dir_ranks, stage in per_rank:
        for way, group in routes:
            assert group == ("default" if ordered else way), f"{label}: a send {way} rode the {group} group"
            ways.add(way)
        assert dir_ranks == (None if ordered else [stage, stage]), label
    assert ways == {"up", "down"}, f"{label}: the placement sends {ways} only"


def _world(cases, nproc: int) -> list[dict]:
    inits = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (model, *_rest) in enumerate(cases):
            torch.manual_seed(i)
            state = load_model(model).module.state_dict()
            torch.save(state, Path(tmp) / f"{i}.pt")
            inits.append(state)
        results = spawn(_run_cases, nproc, cases, tmp)
    _check(cases, results, inits)
    return results


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mp_two_ranks_equal_serial_and_placer_bytes():
    # the placer's own placement (a fast baseline solver): the bytes that cross devices in a step
    # equal what its cost model charges for the same assignment
    outcome = place_model("inception_mini", "localhost", 2, batch=BATCH, input_shape=(3, 16, 16), solver="etf")
    placement = placement_from_outcome(outcome, load_model("inception_mini").module)
    results = _world([*CASES_2, ("inception_mini", 1, 2, placement, {})], 2)
    assert sum(results[-1]["sent_per_rank"]) == predicted_p2p_bytes(outcome) > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mp_and_hybrid_four_ranks_equal_serial():
    _world(CASES_4, 4)
