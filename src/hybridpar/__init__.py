"""hybridpar: plan and run hybrid-parallel deep-learning training.

Pipeline: model -> graph -> cost -> search -> Plan -> parallel (apply it) -> train (run a job).
`plan` and `place` are plain functions; they import the search (torch, solvers) only when called, so
`import hybridpar` stays cheap. The Plan data type is `hybridpar.plans.Plan`.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "check", "full_state_dict", "no_sync", "parallelize", "place", "plan", "project"]


def plan(model, cluster="localhost", gpus: int = 1, batch: int = 32, **options):
    """Per-layer decomposition plan: see :func:`hybridpar.api.plan`."""
    from hybridpar.api import plan as _plan

    return _plan(model, cluster, gpus, batch, **options)


def place(model, cluster="localhost", gpus: int = 2, **options):
    """DLPlacer device placement of one model-parallel group: see :func:`hybridpar.api.place`."""
    from hybridpar.api import place as _place

    return _place(model, cluster, gpus, **options)


def project(model, cluster="localhost", gpus=tuple(2**i for i in range(13)), config=None, **options):
    """End-to-end time-to-target projection: see :func:`hybridpar.api.project`."""
    from hybridpar.api import project as _project

    return _project(model, cluster, gpus, config, **options)


def parallelize(module, plan_or_strategy, **options):
    """Run `module` on the current torch.distributed world with a Plan, a plan.json path or a strategy
    string ("sample=2,channel=2"), with one process's semantics: every rank passes the same global
    batch and gets the whole outputs; any loss, any torch.optim optimizer. In place; returns it.
    Options: inputs="global"|"sample_shard", bn_stats="global"|"local", check_inputs=<example batch>
    (first refuse an op the layout cannot serve, before any collective: see :func:`check`)
    (see hybridpar.parallel.api.parallelize)."""
    import os

    from hybridpar.parallel.api import parallelize as _parallelize

    if isinstance(plan_or_strategy, (str, os.PathLike)) and str(plan_or_strategy).endswith(".json"):
        from hybridpar.plans import load_plan

        plan_or_strategy = load_plan(plan_or_strategy)
    return _parallelize(module, plan_or_strategy, **options)


def check(module, plan_or_strategy, example_inputs, targets=None, *, world_size=None, inputs="global"):
    """Refuse before starting: run `module` under the layout on meta tensors over a fake world of
    `world_size` ranks (default: the current torch.distributed world's), in this process alone (no
    collective; fine under torchrun, with the real process group already up). An op the layout
    cannot serve raises hybridpar.errors.UserError naming the op and the module; otherwise returns
    the DryRun (the collectives one step issues on rank 0). `example_inputs`: what you will pass to
    model(...) (only shapes and dtypes count); `targets`: labels for a cross-entropy loss (without
    them the backward starts from the outputs' sum). Same as parallelize(..., check_inputs=x)."""
    import os

    from hybridpar.parallel.check import check as _check

    if isinstance(plan_or_strategy, (str, os.PathLike)) and str(plan_or_strategy).endswith(".json"):
        from hybridpar.plans import load_plan

        plan_or_strategy = load_plan(plan_or_strategy)
    return _check(module, plan_or_strategy, example_inputs, targets, world_size=world_size, inputs=inputs)


def full_state_dict(module):
    """The undistributed state_dict of a parallelized module, on every rank (collective)."""
    from hybridpar.parallel.api import full_state_dict as _full

    return _full(module)


def no_sync(module):
    """Context manager: backward passes inside accumulate gradients without synchronising them."""
    from hybridpar.parallel.api import no_sync as _no_sync

    return _no_sync(module)
