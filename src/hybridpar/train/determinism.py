"""`--deterministic`: the same plan on the same machine gives bitwise-identical losses and weights.

What varies between runs otherwise: nondeterministic kernels (cuDNN autotuning, atomics in CUDA
scatter/index ops, cuBLAS workspaces), thread counts (a float reduction summed in another order),
and unseeded RNG. gloo's CPU allreduce sums in a fixed ring order for a given world size."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def enable_determinism(seed: int, rank: int = 0) -> None:
    """Deterministic kernels, one intra-op thread, every RNG seeded from (seed, rank)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed by deterministic cuBLAS
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.set_num_threads(1)
    random.seed(seed * 1009 + rank)
    np.random.seed((seed * 1009 + rank) % 2**32)
    torch.manual_seed(seed * 1009 + rank)
