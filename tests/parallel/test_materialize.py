"""Each rank builds only its pieces of the model (hybridpar.parallel.materialize): the weights equal the
model built whole in one process with the same seed, under every layout kind; a factory the replay
cannot follow is said out loud and still gives those weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridpar.parallel.materialize import Materializer, record_build
from hybridpar.train.launch import spawn

from . import _materialize_workers as w


def test_replay_in_one_process_equals_the_factory_and_frees_as_it_goes(monkeypatch):
    from hybridpar.parallel import materialize

    monkeypatch.setattr(materialize, "ROWS_BYTES", 64)  # uniform_ weights drawn a row or two at a time
    meta, record, why = record_build(w.Net)
    assert why is None and all(p.is_meta for p in meta.parameters())
    mat = Materializer(w.Net, record, seed=5)
    mat(meta, None)
    torch.manual_seed(5)
    ref = w.Net().state_dict()
    assert all(torch.equal(meta.state_dict()[k], v) for k, v in ref.items()) and not mat.notes
    # the built model's own storages were freed once copied (it is not what the rank keeps)
    assert all(p.untyped_storage().nbytes() == 0 for p in mat.last_build.conv1.parameters())


def test_a_factory_that_branches_on_the_device_is_caught_and_built_whole():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            if not self.fc.weight.is_meta:  # another op stream on CPU than on meta
                self.fc.weight.data.mul_(2)

    meta, record, why = record_build(Branchy)
    mat = Materializer(Branchy, record, seed=1)
    mat(meta, None)
    assert mat.notes and "op 4: detach after the 4 ops recorded on meta" in mat.notes[0] and "whole" in mat.notes[0]
    torch.manual_seed(1)
    assert torch.equal(meta.fc.weight, Branchy().fc.weight)


def test_two_ranks_sample_channel_filter_and_a_value_reading_factory():
    rows = spawn(w.same_as_serial, 2, [("sample=2", None, False), ("channel=2", None, False),
                                       ("filter=2", None, False), ("channel=2", None, True)], 100)
    assert [r["equal"] for r in rows] == [True] * 4, rows
    assert [bool(r["notes"]) for r in rows] == [False, False, False, True], rows  # trunc_normal_: said
    assert rows[1]["local_bytes"] < rows[0]["local_bytes"]  # channel=2 holds pieces, sample=2 all


@pytest.mark.slow
def test_four_ranks_channel_by_filter_and_a_mixed_plan():
    mixed = {"conv1": "channel=4", "conv2": "sample=4"}
    rows = spawn(w.same_as_serial, 4, [("channel=2,filter=2", None, False), ("sample=2,channel=2", mixed, False)],
                 100)
    assert [r["equal"] for r in rows] == [True, True] and not any(r["notes"] for r in rows), rows
