"""hybridpar.cost: time and memory of nodes and collectives on a cluster (no search, no runtime)."""

from hybridpar.cost.collectives import (
                                        allgather_time,
                                        allreduce_time,
                                        alltoall_time,
                                        broadcast_time,
                                        concurrent_allreduce_time,
                                        concurrent_collective_time,
                                        p2p_time,
                                        reduce_scatter_time,
)
from hybridpar.cost.compute import OpTime, op_time
from hybridpar.cost.memory import MemoryEstimate, training_memory

__all__ = [
                                        "MemoryEstimate",
                                        "OpTime",
                                        "allgather_time",
                                        "allreduce_time",
                                        "alltoall_time",
                                        "broadcast_time",
                                        "concurrent_allreduce_time",
                                        "concurrent_collective_time",
                                        "op_time",
                                        "p2p_time",
                                        "reduce_scatter_time",
                                        "training_memory",
]
