"""Model-parallel (placement) and hybrid DP x MP execution of a Plan on torch.distributed: the user's
own loop (module.parallelize_mp, reached through hybridpar.parallelize), which `hybridpar train` runs
too (train.engine.MPModuleEngine), on MPEngine's stages (partition, owned weights, p2p link, gradient
sync). MPEngine.train_step (an engine-owned loop with a summed loss_fn) remains for benchmarks/bench_mp.py
and its own tests."""

from hybridpar.parallel.pipeline.engine import MPEngine, check_mp_plan
from hybridpar.parallel.pipeline.layout import HybridLayout
from hybridpar.parallel.pipeline.module import MPState, parallelize_mp
from hybridpar.parallel.pipeline.partition import Partition, Transfer, partition_module

__all__ = ["HybridLayout", "MPEngine", "MPState", "Partition", "Transfer", "check_mp_plan",
           "parallelize_mp", "partition_module"]
