"""Gather the distributed weights back into the undistributed model's state_dict on rank 0."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import torch
import torch.distributed as dist

from hybridpar.parallel.pipeline.comm import CommLog, p2p_tag
from hybridpar.parallel.pipeline.layout import HybridLayout


def gather_state(local: Mapping[str, torch.Tensor], schema: Mapping[str, tuple[int, torch.Size, torch.dtype]],
                 layout: HybridLayout, log: CommLog, device: torch.device) -> OrderedDict[str, torch.Tensor] | None:
    """`schema`: key -> (owner device, shape, dtype) in the full state_dict's order; `local`: the
    entries this rank owns. Replica 0 sends its entries to rank 0 in key order (replicas hold
    identical weights); returns the full state_dict (on CPU) on rank 0, None elsewhere. `device`:
    where this rank's tensors live (the backend's transfer device)."""
    if layout.replica != 0:
        return None
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, (owner, shape, dtype) in schema.items():
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if layout.rank == 0:
            if owner == 0:
                out[key] = local[key].detach().to("cpu", copy=True)
            else:
                buf = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(buf, layout.rank_of(0, owner))
                log.record("recv", 2, nbytes, p2p_tag("state", owner), setup=True)
                out[key] = buf.to("cpu")
        elif owner == layout.device:
            dist.send(local[key].detach().contiguous(), 0)
            log.record("send", 2, nbytes, p2p_tag("state", 0), setup=True)
    return out if layout.rank == 0 else None

