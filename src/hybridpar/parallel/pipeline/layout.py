"""Rank layout of hybrid DP x MP: D replicas of an M-device placement on D*M ranks.

Rank r is device r % M of replica r // M, so the devices of one replica are consecutive ranks
(one node of a cluster when M divides the GPUs per node: activations ride the fast links) and the
data-parallel group of device d is {d, M + d, 2M + d, ...}.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from hybridpar.layout import LayerLayout
from hybridpar.layout.groups import shard_groups


@dataclass(frozen=True)
class HybridLayout:
    dp: int
    mp: int
    rank: int

    @property
    def replica(self) -> int:
        return self.rank // self.mp

    @property
    def device(self) -> int:
        return self.rank % self.mp

    def rank_of(self, replica: int, device: int) -> int:
        return replica * self.mp + device

    def dp_ranks(self, device: int) -> list[int]:
        """Ranks holding the same weights (device `device` of every replica): the shard groups of the
        layout vocabulary, with the M devices of a replica in the place of a sample group's G ranks."""
        return list(shard_groups(LayerLayout(sample=self.dp, filter=self.mp))[device])


def dp_group(layout: HybridLayout):
    """This rank's gradient-allreduce group. Every rank creates every group, in the same order,
    as torch.distributed requires; None when there is a single replica."""
    if layout.dp == 1:
        return None
    mine = None
    for d in range(layout.mp):
        g = dist.new_group(layout.dp_ranks(d))
        if d == layout.device:
            mine = g
    return mine
