"""hybridpar.parallel: apply a Plan to an nn.Module and execute it on torch.distributed.

`parallelize(module, plan_or_strategy)` gives the module the layout with one process's semantics;
`full_state_dict(module)` and `no_sync(module)` go with it (all in :mod:`hybridpar.parallel.api`).
Rooms: `mesh` (process groups of the plan's named dims), `dtensor/` (the boundary and our scoped op
rules), `comm/` (collectives with byte accounting, the gradient sync), `styles/` (one distributed
module per layer kind), `pipeline/` (model-parallel partition, p2p, executor), `state`,
`materialize`, `check` (the dry run). It never prices, searches or runs a training job."""

from __future__ import annotations

__all__ = ["full_state_dict", "no_sync", "parallelize"]


def parallelize(module, plan_or_strategy, **options):
    """See :func:`hybridpar.parallel.api.parallelize`."""
    from hybridpar.parallel.api import parallelize as _parallelize

    return _parallelize(module, plan_or_strategy, **options)


def full_state_dict(module):
    """The undistributed state_dict of a parallelized module, on every rank. Collective."""
    from hybridpar.parallel.api import full_state_dict as _full

    return _full(module)


def no_sync(module):
    """Context manager: backward passes inside accumulate gradients without synchronising them."""
    from hybridpar.parallel.api import no_sync as _no_sync

    return _no_sync(module)
