"""Spawned entry points for the rank-failure tests (module-level so that spawn can import them)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hybridpar.train.faults import set_default_timeout


def stuck_peer(rank: int, world: int, port: int, out_dir: str) -> None:
    """Rank 1 stays alive but never joins the collective; rank 0 must get an error, not wait forever."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=set_default_timeout())
    group = dist.new_group(list(range(world)))  # a subgroup: its timeout comes from the default
    if rank == 1:
        time.sleep(6)
    else:
        try:
            dist.all_reduce(torch.ones(1), group=group)
            msg = "completed"
        except RuntimeError as err:
            msg = f"error: {err}"
        Path(out_dir, "rank0.txt").write_text(msg)
    os._exit(0)  # skip destroy_process_group: the peer is gone
