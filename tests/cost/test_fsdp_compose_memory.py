"""Issue 31: the FSDP rules under composed layouts (sample x channel/filter with zero=2|3), from the
traced graph alone: FSDP shards each rank's local pieces of split layers and batch norms (dim 0 padded
to a multiple of S in what it sends), a replicated parameter (a LayerNorm's) stays whole with GradSync;
memory holds the pieces / S. Exact element counts of SmallNet's pieces on grid position 0."""

from __future__ import annotations

import pytest
import torch
from tests.parallel._fsdp_workers import SmallNet
from torch import nn

from hybridpar.cost.layout_comm import fsdp_collectives, model_collectives
from hybridpar.cost.memory import predict_rank_memory
from hybridpar.graph import trace
from hybridpar.layout import LayerLayout

# position 0 of channel=2 (input channels split, outputs whole; bias and batch-norm channel piece 0):
# stem Conv(3, 6): 6x2x9 + 3, bn 3 + 3; body.0 Conv(6, 6): 6x3x9 + 3, bn 3 + 3; body.1 Conv(6, 4):
# 4x3x9 + 2, bn 2 + 2; head Linear(4, 5): 5x2 + 3
PIECES = {"stem": 108 + 3 + 6, "body.0": 162 + 3 + 6, "body.1": 108 + 2 + 4, "head": 10 + 3}
# what FSDP sends: dim 0 padded to a multiple of 2 (bias 3 -> 4, bn 3 -> 4, head's weight 5 rows -> 6)
PADDED = {"stem": 108 + 4 + 8, "body.0": 162 + 4 + 8, "body.1": 108 + 2 + 4, "head": 12 + 4}
NORM = 8  # LayerNorm(4): replicated under channel/filter, whole on every rank, allreduced by GradSync


class NormedNet(SmallNet):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        x = self.stem(x)
        for b in self.body:
            x = b(x)
        return self.head(self.norm(x.mean((2, 3))))


def _graph():
    return trace(NormedNet(), (torch.randn(8, 3, 6, 6),))


@pytest.mark.parametrize("zero", [3, 2])
def test_fsdp_collectives_price_the_local_pieces(zero):
    g = _graph()
    lay = LayerLayout(sample=2, channel=2, zero=zero)
    ops = fsdp_collectives(g, lay, dtype_bytes=4)
    gathers = 2 if zero == 3 else 1
    assert {b for b, _ in ops} == set(PADDED)  # the replicated LayerNorm is not FSDP's
    for block, n in PADDED.items():
        mine = [op for b, op in ops if b == block]
        assert sorted((op.kind, op.phase, op.bytes_) for op in mine) == sorted(
            [("allgather", "fwd", 4 * n), ("reduce_scatter", "grad", 4 * n)]
            + [("allgather", "bwd", 4 * n)] * (gathers - 1))
    step = model_collectives(g, lay, dtype_bytes=4)
    grads = [(name, op.bytes_) for name, op in step if op.phase == "grad" and op.kind == "allreduce"]
    assert len(grads) == 1 and grads[0][1] == 4 * NORM  # only the LayerNorm's allreduce stays (GradSync)
    assert sum(op.bytes_ for name, op in step if name.startswith("fsdp:")) == sum(op.bytes_ for _, op in ops)


def test_memory_holds_the_local_pieces_over_s():
    g = _graph()
    held = (sum(PIECES.values()) / 2 + NORM) * 4
    largest = max(PIECES.values()) * 4
    z3 = predict_rank_memory(g, "sample=2,channel=2,zero=3", optimizer="adamw", framework_bytes=0)
    z2 = predict_rank_memory(g, "sample=2,channel=2,zero=2", optimizer="adamw", framework_bytes=0)
    plain = predict_rank_memory(g, "sample=2,channel=2", optimizer="adamw", framework_bytes=0)
    assert z3.grads_bytes == pytest.approx(held) and z3.optimizer_bytes == pytest.approx(2 * held)
    assert z3.weights_bytes == pytest.approx(held + largest)  # one block's pieces gathered in flight
    assert z2.weights_bytes == pytest.approx(held + sum(PIECES.values()) * 4)  # every block kept gathered
    assert z3.buckets_bytes == pytest.approx(largest + NORM * 4)  # a block before its reduce-scatter + GradSync's
    assert z3.activations_bytes == plain.activations_bytes and z3.io_bytes == plain.io_bytes
    assert z3.total_bytes < plain.total_bytes
