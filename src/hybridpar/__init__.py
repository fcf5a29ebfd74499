"""hybridpar: plan and run hybrid-parallel deep-learning training.

Pipeline: model -> graph -> cost -> search -> Plan -> runtime.
`plan` and `place` are plain functions; they import the search (torch, solvers) only when called, so
`import hybridpar` stays cheap. The Plan data type is `hybridpar.plans.Plan`.
"""

from __future__ import annotations

import sys

__version__ = "0.1.0"

__all__ = ["__version__", "check", "full_state_dict", "no_sync", "parallelize", "place", "plan"]


def _model_arg(model, example_inputs):
    """A zoo name / file spec / Graph as is; an nn.Module with its example inputs as (module, inputs)."""
    if example_inputs is None:
        torch = sys.modules.get("torch")  # a module exists only if torch is loaded: never import it here
        if torch is not None and isinstance(model, torch.nn.Module):
            from hybridpar.errors import UserError

            raise UserError("an nn.Module needs example_inputs (a tensor or a tuple of tensors)")
        return model
    return (model, example_inputs)


def plan(model, cluster="localhost", gpus: int = 1, batch: int = 32, *, example_inputs=None, **options):
    """Per-layer decomposition plan of `model` on `gpus` devices of `cluster` at global batch `batch`.

    `model`: a zoo name, `path/to/file.py:factory`, a traced Graph, or an `nn.Module` with
    `example_inputs`. `cluster`: a preset name, a cluster file, or a `Cluster`. `options` are those
    of :func:`hybridpar.search.layers.planner.plan_model` (strategy, memory_limit, dtype, ...)."""
    from hybridpar.search.layers.planner import plan_model

    return plan_model(_model_arg(model, example_inputs), cluster, gpus, batch, **options)


def place(model, cluster="dgx1-v100", devices: int = 2, *, example_inputs=None, **options):
    """DLPlacer device placement of `model` over `devices` devices of `cluster`.

    `model` and `cluster` as for :func:`plan`; `options` are those of
    :func:`hybridpar.search.placer.place_model` (solver, time_limit_s, batch, ...)."""
    from hybridpar.search.placer import place_model

    return place_model(_model_arg(model, example_inputs), cluster, devices, **options)


def parallelize(module, plan_or_strategy, **options):
    """Run `module` on the current torch.distributed world with a Plan, a plan.json path or a strategy
    string ("sample=2,channel=2"), with one process's semantics: every rank passes the same global
    batch and gets the whole outputs; any loss, any torch.optim optimizer. In place; returns it.
    Options: inputs="global"|"sample_shard", bn_stats="global"|"local", check_inputs=<example batch>
    (first refuse an op the layout cannot serve, before any collective: see :func:`check`)
    (see hybridpar.runtime.parallel_model.parallelize)."""
    import os

    from hybridpar.runtime.parallel_model import parallelize as _parallelize

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

    from hybridpar.runtime.dry_run import check as _check

    if isinstance(plan_or_strategy, (str, os.PathLike)) and str(plan_or_strategy).endswith(".json"):
        from hybridpar.plans import load_plan

        plan_or_strategy = load_plan(plan_or_strategy)
    return _check(module, plan_or_strategy, example_inputs, targets, world_size=world_size, inputs=inputs)


def full_state_dict(module):
    """The undistributed state_dict of a parallelized module, on every rank (collective)."""
    from hybridpar.runtime.parallel_model import full_state_dict as _full

    return _full(module)


def no_sync(module):
    """Context manager: backward passes inside accumulate gradients without synchronising them."""
    from hybridpar.runtime.parallel_model import no_sync as _no_sync

    return _no_sync(module)
