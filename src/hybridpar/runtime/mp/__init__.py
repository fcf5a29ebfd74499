"""Model-parallel (placement) and hybrid DP x MP execution of a Plan on torch.distributed."""

from hybridpar.runtime.mp.engine import MPEngine, check_mp_plan, loss_sum
from hybridpar.runtime.mp.layout import HybridLayout
from hybridpar.runtime.mp.partition import Partition, Transfer, partition_module

__all__ = ["HybridLayout", "MPEngine", "Partition", "Transfer", "check_mp_plan", "loss_sum", "partition_module"]
