"""What the runtime runs distributed and how it buckets gradients: facts of `hybridpar.parallel` that
the cost model prices, kept here (below both) so the two share one rule and neither imports the other.
"""

from __future__ import annotations

# the classes hybridpar.parallel replaces by distributed layers (parallel/styles/table.py PARALLEL_STYLES:
# exact types; a subclass such as nn.MultiheadAttention's NonDynamicallyQuantizableLinear keeps its own
# forward and stays replicated, as does a functional F.linear/F.conv2d)
DISTRIBUTED_CLASSES = {"conv2d": "torch.nn.modules.conv.Conv2d", "linear": "torch.nn.modules.linear.Linear"}

# hybridpar.parallel.comm.grad_sync's bucket size, priced by the planner (cost.layout_comm.bucket_schedule).
# Small buckets overlap more on CPU; DDP's 25 MiB suits fast GPU links.
BUCKET_BYTES = 4 << 20


def runs_distributed(op: str, module_class: str | None, groups: int = 1, padding_mode: str = "zeros") -> bool:
    """The runtime's rule for a conv/linear (parallel/styles/table.py asks it of modules, the cost
    model of traced nodes): an exact nn.Conv2d with groups == 1 and zeros padding, or an exact
    nn.Linear, runs as a distributed layer; anything else (grouped/depthwise convs, another padding
    mode, subclasses, functional calls) runs whole on every rank, its parameters replicated.
    `module_class` None: a node built by hand, taken as the plain layer it names."""
    if op not in DISTRIBUTED_CLASSES or (module_class is not None and module_class != DISTRIBUTED_CLASSES[op]):
        return False
    return op != "conv2d" or (groups == 1 and padding_mode == "zeros")
