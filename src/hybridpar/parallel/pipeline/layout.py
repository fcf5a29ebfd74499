"""Rank layout of hybrid DP x MP: D replicas of an M-stage placement on D*M ranks, the mesh
(sample, stage) of hybridpar.parallel.mesh.MeshDims.hybrid.

Rank r is stage (device) r % M of replica r // M, so the devices of one replica are consecutive ranks
(one node of a cluster when M divides the GPUs per node: activations ride the fast links) and the
data-parallel group of device d is {d, M + d, 2M + d, ...}.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from hybridpar.parallel.mesh import STAGE_DIM, Group, MeshDims, new_groups


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

    @property
    def dims(self) -> MeshDims:
        return MeshDims.hybrid(self.dp, self.mp)

    def rank_of(self, replica: int, device: int) -> int:
        return replica * self.mp + device

    def dp_ranks(self, device: int) -> list[int]:
        """Ranks holding the same weights (device `device` of every replica): the mesh's groups over
        its sample dim."""
        return list(self.dims.groups("sample")[device])

    def stage_ranks(self) -> list[int]:
        """This rank's replica: its M stages."""
        return list(self.dims.group_of(self.rank, STAGE_DIM))


def dp_group(layout: HybridLayout) -> Group | None:
    """This rank's gradient-allreduce group. Every rank creates every group, in the same order,
    as torch.distributed requires; None when there is a single replica."""
    if layout.dp == 1:
        return None
    return new_groups(layout.dims.groups("sample"))[tuple(layout.dp_ranks(layout.device))]


def direction_groups(layout: HybridLayout) -> tuple[dist.ProcessGroup, dist.ProcessGroup] | None:
    """Two process groups over this rank's replica (every rank creates every replica's, in the same
    order): transfers to a higher device ride the first, to a lower one the second (pipeline.p2p.Link
    says why). None with one device."""
    if layout.mp == 1:
        return None
    stages = layout.dims.groups(STAGE_DIM)
    mine = tuple(layout.stage_ranks())
    up, down = new_groups(stages)[mine], new_groups(stages)[mine]
    assert up.pg is not None and down.pg is not None  # more than one rank
    return up.pg, down.pg
