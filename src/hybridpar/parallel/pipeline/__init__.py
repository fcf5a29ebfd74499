"""Model-parallel (placement) and hybrid DP x MP execution of a Plan on torch.distributed."""

from hybridpar.parallel.pipeline.engine import MPEngine, check_mp_plan, loss_sum
from hybridpar.parallel.pipeline.layout import HybridLayout
from hybridpar.parallel.pipeline.partition import Partition, Transfer, partition_module

__all__ = ["HybridLayout", "MPEngine", "Partition", "Transfer", "check_mp_plan", "loss_sum", "partition_module"]
