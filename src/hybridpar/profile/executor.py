"""The model-parallel executor's own cost per graph node, measured on this machine.

The MP runtime (hybridpar.parallel.pipeline) runs each rank's share of the model node by node through a
torch.fx interpreter and threads a token through its transfers; eager PyTorch calls the module
directly. On a CPU that difference is Python work per node that the op table does not hold (a few
tens of microseconds per node, against ops of a few microseconds in small models). Measured as CPU
time of this thread (time.thread_time), so time other jobs take from the core does not count: a
chain of small Linear + ReLU layers, one training step through the executor on one device against
the same step in eager PyTorch, difference per fx node.
"""

from __future__ import annotations

import statistics

import torch
from torch import nn

from hybridpar.profile.timing import measure


class _Chain(nn.Module):
    def __init__(self, layers: int, width: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def mp_node_overhead_s(layers: int = 48, width: int = 8, *, warmup: int = 3, repeats: int = 15) -> float:
    """Seconds of CPU time the MP executor adds per fx node to a training step (forward + backward)."""
    from hybridpar.parallel.comm.log import CommLog
    from hybridpar.parallel.pipeline.executor import run_forward
    from hybridpar.parallel.pipeline.p2p import Link
    from hybridpar.parallel.pipeline.partition import partition_module

    torch.manual_seed(0)
    eager = _Chain(layers, width)
    part = partition_module(_Chain(layers, width), {}, 1)
    link = Link(rank_of_device=lambda d: d, log=CommLog(), prepost=True)
    x = torch.randn(4, width)
    cpu = torch.device("cpu")

    def eager_step() -> None:
        eager(x).sum().backward()

    def executor_step() -> None:
        out, token = run_forward(part, 0, link, (x,), {}, 0, cpu)
        torch.autograd.backward([out.sum(), token], [None, torch.zeros_like(token)])
        link.wait_all()

    def cpu_median(fn) -> float:
        return measure(fn, warmup=warmup, repeats=repeats).median_s

    # interleave the two so that a change of CPU frequency or cache pressure hits both alike
    diffs = [cpu_median(executor_step) - cpu_median(eager_step) for _ in range(3)]
    nodes = sum(1 for n in part.gm.graph.nodes if n.op not in ("placeholder", "output"))
    return max(0.0, statistics.median(diffs) / nodes)
