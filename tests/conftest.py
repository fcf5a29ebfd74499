import os

# Ranks time-share 2 cores: one intra-op thread per process keeps timings sane.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)
