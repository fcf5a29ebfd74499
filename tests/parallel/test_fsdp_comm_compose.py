"""Issue 31: FSDP2 on the sample dimension composed with channel/filter layouts (4 ranks): each rank's
FSDP all-gathers and reduce-scatters = hybridpar.cost.layout_comm.fsdp_collectives at its grid position
(its local weight pieces, dim 0 padded to a multiple of S), and the whole step's bytes per kind =
model_collectives (FSDP's collectives replacing the gradient allreduces of the pieces it holds)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from tests.parallel._fsdp_workers import SmallNet, make_model, train

import hybridpar

STRATEGIES = ("sample=2,channel=2,zero=3", "sample=2,channel=2,zero=2", "sample=2,filter=2,zero=3")


def run_compose() -> dict:
    out: dict = {"rank": dist.get_rank()}
    for strategy in STRATEGIES:
        model = hybridpar.parallelize(make_model(), strategy)
        log = model.hybridpar.grid.comm_log
        train(model, "sgd", steps=1)  # FSDP's lazy init on the first step
        log.mark_step()
        train(model, "sgd", steps=1)
        out[strategy] = [(r.kind, r.tag, r.bytes_) for r in log.step_records()]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, out)  # spawn returns rank 0's result: every rank's records
    return every


def _fsdp(records) -> Counter:
    return Counter((tag.split(":")[1], kind, tag.split(":")[2], b) for kind, tag, b in records
                   if tag.startswith("fsdp:"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_composed_fsdp_bytes_sent_equal_predicted():
    from hybridpar.cost.layout_comm import bytes_by_kind, fsdp_collectives, model_collectives
    from hybridpar.graph import trace
    from hybridpar.plans import parse_strategy
    from hybridpar.train.launch import spawn

    got = spawn(run_compose, 4)
    g = trace(SmallNet(), (torch.randn(8, 3, 6, 6),))
    for res in got:
        rank = res["rank"]
        for strategy in STRATEGIES:
            lay = parse_strategy(strategy, 4).layout
            sent = res[strategy]
            want = fsdp_collectives(g, lay, position=rank % lay.g_size, dtype_bytes=8)
            assert _fsdp(sent) == Counter((b, op.kind, op.phase, op.bytes_) for b, op in want), (strategy, rank)
            step = model_collectives(g, lay, rank=rank, dtype_bytes=8, whole_outputs=True)  # the API's global form
            assert _by_kind(sent) == bytes_by_kind(step), (strategy, rank, sent)


def _by_kind(records) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind, _, b in records:
        out[kind] = out.get(kind, 0) + b
    return dict(sorted(out.items()))
