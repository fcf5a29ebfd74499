"""hybridpar.runtime: executing a Plan on torch.distributed.

Public API: `parallelize(module, plan_or_strategy)` (replace layers in place by their distributed
forms), `make_engine(module, plan)` (the training engine), and the modules launch (ranks), data
(--data sets), comm_log (communication accounting) and train_loop (the per-rank loop)."""

from __future__ import annotations

__all__ = ["make_engine", "parallelize"]


def __getattr__(name: str):  # lazy: importing the package should not pull torch.distributed
    if name == "parallelize":
        from hybridpar.runtime.parallelize import parallelize

        return parallelize
    if name == "make_engine":
        from hybridpar.runtime.engine import make_engine

        return make_engine
    raise AttributeError(name)
