"""Batch norm across the replicas of hybrid DP x MP: each batch norm placed on this device (BatchNorm1d,
2d, 3d, SyncBatchNorm and their subclasses: the traced graph calls every one as a module,
hybridpar.graph.runnable) is replaced by the runtime's DistBatchNorm (whole channels, any rank of input)
over this device's data-parallel group, so its statistics cover the global batch and the result equals
serial training. A batch norm the swap cannot reach (F.batch_norm called in the model's own code) is
refused before any step (`unreachable_batch_norms`), never run with per-replica statistics."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

from hybridpar.parallel.comm.log import CommLog
from hybridpar.parallel.mesh import Group
from hybridpar.parallel.pipeline.layout import HybridLayout
from hybridpar.parallel.pipeline.partition import Partition
from hybridpar.parallel.styles.norm import DistBatchNorm, NormComm

_FUNCTIONAL = (F.batch_norm, torch.batch_norm, torch.native_batch_norm)


def sync_batch_norms(module: nn.Module, part: Partition, layout: HybridLayout, group: Group, log: CommLog) -> int:
    """Swap this device's batch norms (in `module` and the traced graph module) for ones whose
    statistics run over `group` (this device's data-parallel group); returns how many were swapped.
    The parameters and buffers keep their state_dict names."""
    swapped = 0
    for node in part.nodes:
        if node.op != "call_module" or part.device_of[node.name] != layout.device:
            continue
        target = str(node.target)
        bn = part.gm.get_submodule(target)
        if not isinstance(bn, nn.modules.batchnorm._BatchNorm):
            continue
        dist_bn = DistBatchNorm(bn, slice(None), NormComm(group, log, target), stats="global")
        parent, _, leaf = target.rpartition(".")
        for root in (module, part.gm):
            setattr(root.get_submodule(parent) if parent else root, leaf, dist_bn)
        swapped += 1
    return swapped


def unreachable_batch_norms(gm: fx.GraphModule) -> list[str]:
    """Nodes of the traced graph that compute batch-norm statistics outside a batch-norm module
    (F.batch_norm in the model's own forward): the global-statistics swap cannot reach them."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _FUNCTIONAL:
            training = node.kwargs.get("training", node.args[5] if len(node.args) > 5 else False)
            if training is not False:
                out.append(node.name)
            continue
        name = getattr(node.target, "__name__", str(node.target))  # torch.export's ATen ops
        if "batch_norm" in name and not any(w in name for w in ("backward", "no_training", "update_stats",
                                                                   "elemt", "gather_stats")):
            out.append(node.name)
    return out


def has_batch_norm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())
