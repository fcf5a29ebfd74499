"""Models for benchmarks/bench_memory_fsdp.py and benchmarks/bench_fsdp.py (not in the zoo): a wide CNN,
whose weights dominate (channel/filter and FSDP both cut them), and an activation-heavy CNN, whose
activations dominate (recomputation frees them). `hybridpar train --model benchmarks/_fsdp_bench_models.py:NAME`."""

from __future__ import annotations

from torch import nn


class BlockCNN(nn.Module):
    """A stem, `depth` conv-BN-ReLU blocks of `width` channels (a ModuleList: the runtime's FSDP and
    recomputation blocks), global average pooling and a linear head."""

    def __init__(self, width: int, depth: int, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width),
                                                  nn.ReLU()) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


# name -> (factory arguments, input shape C,H,W, global batch)
MODELS = {
    "wide_cnn": ((768, 4), "3,8,8", 8),  # 20.25 MiB of weights per block (768*768*9*4 B): 81 MiB in all
    "wide_cnn_quick": ((256, 3), "3,8,8", 8),
    "act_cnn": ((64, 6), "3,64,64", 16),  # 16 MiB per activation tensor at batch 16
    "act_cnn_quick": ((32, 4), "3,32,32", 8),
}


def wide_cnn() -> BlockCNN:
    return BlockCNN(*MODELS["wide_cnn"][0])


def wide_cnn_quick() -> BlockCNN:
    return BlockCNN(*MODELS["wide_cnn_quick"][0])


def act_cnn() -> BlockCNN:
    return BlockCNN(*MODELS["act_cnn"][0])


def act_cnn_quick() -> BlockCNN:
    return BlockCNN(*MODELS["act_cnn_quick"][0])
