"""hybridpar.runtime: executing a Plan on torch.distributed.

Public API (also at the top level, `hybridpar.parallelize` ...): `parallelize(module, plan_or_strategy)`
(the model runs the layout with one process's semantics), `full_state_dict(module)`, and
`make_engine(module, plan)` (the engine `hybridpar train` drives); modules launch (ranks), data
(--data sets), comm_log (communication accounting) and train_loop (the per-rank loop)."""

from __future__ import annotations

__all__ = ["full_state_dict", "make_engine", "parallelize"]


def parallelize(module, plan_or_strategy, **options):
    """See hybridpar.runtime.parallel_model.parallelize."""
    from hybridpar.runtime.parallel_model import parallelize as _parallelize

    return _parallelize(module, plan_or_strategy, **options)


def full_state_dict(module):
    """The undistributed state_dict of a parallelized module, on every rank. Collective."""
    from hybridpar.runtime.parallel_model import full_state_dict as _full

    return _full(module)


def make_engine(module, plan, **options):
    """See hybridpar.runtime.engine.make_engine."""
    from hybridpar.runtime.engine import make_engine as _make_engine

    return _make_engine(module, plan, **options)
