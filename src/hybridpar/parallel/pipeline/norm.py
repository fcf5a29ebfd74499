"""Batch norm across the replicas of hybrid DP x MP: each BatchNorm2d placed on this device is
replaced by the runtime's DistBatchNorm2d (whole channels) over this device's data-parallel group,
so its statistics cover the global batch and the result equals serial training."""

from __future__ import annotations

from torch import nn

from hybridpar.parallel.comm.log import CommLog
from hybridpar.parallel.mesh import Group
from hybridpar.parallel.pipeline.layout import HybridLayout
from hybridpar.parallel.pipeline.partition import Partition
from hybridpar.parallel.styles.norm import DistBatchNorm, NormComm


def sync_batch_norms(module: nn.Module, part: Partition, layout: HybridLayout, pg, log: CommLog) -> int:
    """Swap this device's BatchNorm2d modules (in `module` and the traced graph module); returns how
    many were swapped. The parameters and buffers keep their state_dict names."""
    group = Group(tuple(layout.dp_ranks(layout.device)), pg, layout.replica)
    swapped = 0
    for node in part.nodes:
        if node.op != "call_module" or part.device_of[node.name] != layout.device:
            continue
        target = str(node.target)
        bn = part.gm.get_submodule(target)
        if not isinstance(bn, nn.BatchNorm2d):
            continue
        dist_bn = DistBatchNorm(bn, slice(None), NormComm(group, log, target), stats="global")
        parent, _, leaf = target.rpartition(".")
        for root in (module, part.gm):
            setattr(root.get_submodule(parent) if parent else root, leaf, dist_bn)
        swapped += 1
    return swapped


def has_batch_norm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())
