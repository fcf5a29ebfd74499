"""hybridpar: plan and run hybrid-parallel deep-learning training.

Pipeline: model -> graph -> cost -> search -> Plan -> parallel (apply it) -> train (run a job).
`plan` and `place` are plain functions; they import the search (torch, solvers) only when called, so
`import hybridpar` stays cheap. The Plan data type is `hybridpar.plans.Plan`.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "check", "full_state_dict", "no_sync", "parallelize", "place", "plan", "project"]


def plan(model, cluster="localhost", gpus: int = 1, batch: int = 32, config=None, **options):
    """Per-layer decomposition plan (`config`: a PlannerConfig, or its fields as keywords): see
    :func:`hybridpar.api.plan`."""
    from hybridpar.api import plan as _plan

    return _plan(model, cluster, gpus, batch, config, **options)


def place(model, cluster="localhost", gpus: int = 2, config=None, **options):
    """DLPlacer device placement of one model-parallel group (`config`: a PlacerConfig, or its fields as
    keywords): see :func:`hybridpar.api.place`."""
    from hybridpar.api import place as _place

    return _place(model, cluster, gpus, config, **options)


def project(model, cluster="localhost", gpus=tuple(2**i for i in range(13)), config=None, **options):
    """End-to-end time-to-target projection: see :func:`hybridpar.api.project`."""
    from hybridpar.api import project as _project

    return _project(model, cluster, gpus, config, **options)


def parallelize(module, plan_or_strategy, **options):
    """Run `module` on the current torch.distributed world with a Plan, a plan.json path or a strategy
    string ("sample=2,channel=2", "mp=2", "mp=2,sample=2"), with one process's semantics: every rank
    passes the same global batch (any number of inputs) and gets the whole outputs (tensors, tuples,
    dicts); any loss, any torch.optim optimizer over `module.parameters()`. In place; returns it.
    Options: inputs="global"|"sample_shard", bn_stats="global"|"local", check_inputs=<example batch>
    (first refuse an op the layout cannot serve, before any collective: see :func:`check`)
    (see hybridpar.parallel.api.parallelize).

    Model parallelism (mp > 1): a Plan with its placement (`hybridpar place --out`), or `placement=`
    {module name: device}; without one, `example_inputs=` (a tuple: one global batch's inputs) lets
    rank 0 run DLPlacer (as `train --strategy mp=2` does; `cluster=`, default localhost) and share its
    placement with every rank. See hybridpar.parallel.pipeline.module."""
    import os

    from hybridpar.parallel.api import parallelize as _parallelize

    if isinstance(plan_or_strategy, (str, os.PathLike)) and str(plan_or_strategy).endswith(".json"):
        from hybridpar.plans import load_plan

        plan_or_strategy = load_plan(plan_or_strategy)
    cluster = options.pop("cluster", "localhost")
    if options.get("example_inputs") is not None and "place" not in options and "placement" not in options:
        options["place"] = _placer(tuple(options["example_inputs"]), cluster, options.get("time_chunks"),
                                   options.get("schedule"), options.get("micro_batches"))
    return _parallelize(module, plan_or_strategy, **options)


def _placer(example_inputs: tuple, cluster: str, time_chunks: int | None = None, schedule: str | None = None,
            micro_batches: int | None = None):
    """place(plan, module) for hybridpar.parallel: DLPlacer's placement of one replica's batch (a
    slice of `example_inputs`), found on rank 0 and sent to every rank (the ranks must agree); with
    `time_chunks` K, priced (and its stacked recurrent layers placed one by one) as the wavefront runs;
    with `schedule` (and `micro_batches`), placed and priced for it (1f1b: a chain of stages)."""

    def place(plan_, module):
        import torch.distributed as dist

        from hybridpar.api import place as _place
        from hybridpar.parallel.pipeline.engine import batch_rows, split_rows
        from hybridpar.search.placer.module_placement import placement_from_outcome

        box = [None]
        if dist.get_rank() == 0:
            n = batch_rows(example_inputs)
            mine = tuple(split_rows(list(example_inputs), n, plan_.dp)[0]) if plan_.dp > 1 else example_inputs
            try:
                # each one given is the run's (as api.with_placement passes them): a count the placer
                # chose itself would be priced while the run used the user's
                asked = {k: v for k, v in (("schedule", schedule), ("micro_batches", micro_batches)) if v is not None}
                outcome = _place(module, cluster, plan_.mp, example_inputs=mine, batch=batch_rows(mine),
                                 time_chunks=time_chunks, **asked)
                box[0] = {"placement": placement_from_outcome(outcome, module, mine),
                          "micro_batches": outcome.plan.micro_batches,  # the placer's GPipe count
                          "schedule": outcome.plan.schedule,  # and schedule (step()'s)
                          "time_chunks": outcome.plan.time_chunks}
            except Exception as err:  # noqa: BLE001 - every rank raises it, not only rank 0
                box[0] = {"error": f"{type(err).__name__}: {err}"}
        dist.broadcast_object_list(box, src=0)
        got = box[0]
        assert isinstance(got, dict)
        if "error" in got:
            from hybridpar.errors import UserError

            raise UserError(f"placement of mp={plan_.mp} on rank 0 failed: {got['error']}")
        return plan_.model_copy(update={"placement": got["placement"], "micro_batches": got["micro_batches"],
                                        "schedule": got.get("schedule"),
                                        "time_chunks": got.get("time_chunks")})

    return place


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
