"""The workflows Python and the command line share: plan, place, project, and a placement for a run.

Each CLI command parses its flags, makes one call here and prints the result, so `hybridpar plan ...`
and `hybridpar.plan(...)` predict the same thing (the dry run's re-pricing included).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hybridpar.errors import UserError

if TYPE_CHECKING:
    from torch import nn

    from hybridpar.plans import Plan
    from hybridpar.search.layers.planner import PlannerConfig, PlanResult
    from hybridpar.search.placer.api import PlaceOutcome
    from hybridpar.search.placer.config import PlacerConfig

DEFAULT_CLUSTER = "localhost"  # one default everywhere: this machine, measured by `hybridpar profile`
PLACER_TIME_LIMIT_S = 10.0  # a run's placement: the ILP is warm-started from the best heuristic


def _model_arg(model, example_inputs):
    """A zoo name / file spec / Graph as is; an nn.Module with its example inputs as (module, inputs)."""
    if example_inputs is None:
        import sys

        torch = sys.modules.get("torch")  # a module exists only if torch is loaded: never import it here
        if torch is not None and isinstance(model, torch.nn.Module):
            raise UserError("an nn.Module needs example_inputs (a tensor or a tuple of tensors)")
        return model
    return (model, example_inputs)


def plan(model, cluster=DEFAULT_CLUSTER, gpus: int = 1, batch: int = 32, config: PlannerConfig | None = None, *,
         example_inputs=None, dry_run: bool | None = None, progress: Callable[[str], None] | None = None,
         **options) -> PlanResult:
    """Per-layer decomposition plan of `model` on `gpus` devices of `cluster` at global batch `batch`.

    `model`: a zoo name, `path/to/file.py:factory`, a traced Graph, or an `nn.Module` with
    `example_inputs`. `cluster`: a preset name, a cluster file, or a `Cluster`. `config`: a
    :class:`hybridpar.search.layers.planner.PlannerConfig`; keyword `options` are its fields, over it
    (strategy, memory_limit, dtype, input_shape, optimizer, momentum, channels_last, ...). `devices=` is
    the old name of `gpus` and still accepted. `channels_last=True` prices 4-D ops as `train
    --channels-last` runs them (the plan's `channels_last` field and notes say from what). `dry_run`:
    run the planned layout on meta tensors first and price what DTensor redistributes between our
    layers (default: on for file models, whose code between layers may mix channels; off for the zoo);
    False also prices layouts the runtime cannot run (a what-if)."""
    from hybridpar.search.layers.planner import PlannerConfig, plan_model

    gpus = options.pop("devices", gpus)
    cfg = PlannerConfig.of(config, {**options, "runnable_only": dry_run is not False})
    from hybridpar.search.layers.uncalibrated import with_format_note, with_uncalibrated_note

    if not (dry_run if dry_run is not None else (isinstance(model, str) and ":" in model)):
        res = with_baseline_notes(plan_model(_model_arg(model, example_inputs), cluster, gpus, batch, cfg,
                                             progress=progress))
        return with_format_note(with_uncalibrated_note(res, _model_arg(model, example_inputs), cluster, cfg),
                                _model_arg(model, example_inputs), cluster, cfg)
    excluded: dict[str, str] = {}  # strategy -> the dry run's refusal
    while True:  # ends: each pass excludes a layout the last plan used, or returns
        cfg_ = dataclasses.replace(cfg, exclude_layouts=(*cfg.exclude_layouts, *excluded))
        res = plan_model(_model_arg(model, example_inputs), cluster, gpus, batch, cfg_, progress=progress)
        if progress is not None:
            progress("dry run of the layout on meta tensors")
        try:
            res = with_redistributions(res, model, cfg.input_shape, cluster, cfg.calibration)
            break
        except UserError as err:
            refused = _split_layouts(res.plan)
            if cfg.strategy is not None or not refused or set(refused) <= set(excluded):
                raise  # a fixed --strategy, or a refusal no exclusion can avoid: the user's to see
            excluded.update(dict.fromkeys(refused, str(err)))
    res = with_baseline_notes(_with_exclusion_notes(res, excluded))
    return with_format_note(with_uncalibrated_note(res, _model_arg(model, example_inputs), cluster, cfg),
                            _model_arg(model, example_inputs), cluster, cfg)


def _split_layouts(plan_: Plan) -> list[str]:
    """The strategies of the plan's layouts that split a layer (the ones its dry run can refuse)."""
    lays = [plan_.default_layout, *plan_.layers.values()]
    return sorted({lay.to_strategy() for lay in lays if lay.g_size > 1 or lay.spatial > 1})


def _with_exclusion_notes(res: PlanResult, excluded: dict[str, str]) -> PlanResult:
    """The plan's notes saying which layouts the search left out because the dry run refused them."""
    if not excluded:
        return res
    notes = [f"excluded {lay}: the dry run refused it ({why})" for lay, why in excluded.items()]
    return dataclasses.replace(res, plan=res.plan.model_copy(update={"notes": [*res.plan.notes, *notes]}))


def with_baseline_notes(res: PlanResult) -> PlanResult:
    """The plan's notes with its standing against both baselines, data parallelism and FSDP + full
    recomputation (search.layers.fsdp_baseline.baseline_notes): the HTML report shows a plan's notes."""
    from hybridpar.search.layers.fsdp_baseline import baseline_notes

    notes = [n for n in baseline_notes(res) if n not in res.plan.notes]
    if not notes:
        return res
    return dataclasses.replace(res, plan=res.plan.model_copy(update={"notes": [*res.plan.notes, *notes]}))


def with_redistributions(res: PlanResult, model: str, shape, cluster, calibration=None) -> PlanResult:
    """The plan's prediction plus what the dry run finds DTensor redistributing between our layers
    (a softmax or mean over channels, a reshape of an unevenly split tensor ...): bytes per kind, and
    their time, priced on consecutive ranks of the cluster (the sample group's), not overlapped; and
    the Python of every redistribution DTensor runs in a step, with a message or without, at the
    calibration's measured cost per call (hybridpar.profile.runtime_overhead: localhost only)."""
    from hybridpar.cluster import Cluster, load_cluster
    from hybridpar.cost import collectives as cc
    from hybridpar.cost.compute import runtime_overhead_for
    from hybridpar.graph.models import load_model
    from hybridpar.parallel.check import dry_run

    plan_ = res.plan
    if plan_.mp > 1 or plan_.default_layout.g_size == 1:
        return res  # sample-only or model-parallel: no DTensor between layers
    loaded = load_model(model, batch=plan_.batch, input_shape=shape, device="meta")  # shapes only: no weights
    run = dry_run(loaded.module, plan_, tuple(loaded.example_inputs), world_size=plan_.world_size)
    cl = cluster if isinstance(cluster, Cluster) else load_cluster(cluster, gpus=plan_.world_size)
    price = {"allgather": cc.allgather_time, "reduce_scatter": cc.reduce_scatter_time,
             "allreduce": cc.allreduce_time, "alltoall": cc.alltoall_time}
    records = [r for r in run.dtensor if r["group_size"] > 1 and not r.get("priced")]  # priced: in the plan
    records = _not_in_plan(records, res)
    overhead = runtime_overhead_for(cl.device, calibration)
    per_move = overhead.redistribute_s if overhead is not None and overhead.redistribute_s is not None else 0.0
    moves_s = run.redistributions * per_move * cl.device.time_share
    if not records and not moves_s:
        return res
    extra_s = sum(price.get(r["kind"], cc.allgather_time)(r["bytes"], tuple(range(r["group_size"])), cl)
                  for r in records)
    pr = res.prediction
    comm = dict(pr.comm_bytes)
    for r in records:
        comm[r["kind"]] = comm.get(r["kind"], 0) + r["bytes"]
    notes = []
    if records:
        mods = sorted({r["module"] for r in records})
        notes.append(f"dry run: DTensor redistributes between layers in {', '.join(mods[:4])}"
                     f"{' ...' if len(mods) > 4 else ''}: {len(records)} collective(s), "
                     f"{sum(r['bytes'] for r in records):,} bytes per step, +{extra_s * 1e3:.3f} ms (priced on "
                     "consecutive ranks, not overlapped)")
    if moves_s:
        notes.append(f"dry run: DTensor runs {run.redistributions} redistribution(s) per step, +{moves_s * 1e3:.3f} ms "
                     f"of its Python ({per_move * 1e6:.0f} us each, measured by `hybridpar profile`)")
    pr = pr.model_copy(update={"comm_bytes": comm, "step_time_s": pr.step_time_s + extra_s + moves_s,
                               "compute_s": pr.compute_s + moves_s,
                               "comm_s": pr.comm_s + extra_s, "exposed_comm_s": pr.exposed_comm_s + extra_s})
    plan_ = plan_.model_copy(update={"predicted": pr, "notes": [*plan_.notes, *notes]})
    return dataclasses.replace(res, plan=plan_, prediction=pr)


def _not_in_plan(records: list[dict], res: PlanResult) -> list[dict]:
    """The dry run's records less DTensor's moves the plan prices itself (LayerCost.dtensor_moves: a
    whole tensor's gradient gather, which the runtime does not mark), matched by kind, group size and
    bytes: a match adds the same bytes and time either way."""
    priced = Counter(m for row in res.layers for m in row.cost.dtensor_moves)
    out = []
    for r in records:
        key = (r["kind"], r["group_size"], r["bytes"])
        if priced[key] > 0:
            priced[key] -= 1
        else:
            out.append(r)
    return out


def place(model, cluster=DEFAULT_CLUSTER, gpus: int = 2, config: PlacerConfig | None = None, *,
          example_inputs=None, **options) -> PlaceOutcome:
    """DLPlacer device placement of `model` over `gpus` devices of `cluster` (one model-parallel group).

    `model` and `cluster` as for :func:`plan`; `config`: a
    :class:`hybridpar.search.placer.config.PlacerConfig`; keyword `options` are its fields, over it
    (solver, time_limit_s, batch, optimizer, momentum, ...). The optimizer is named as `train` takes it
    (sgd with momentum, adamw, lars; the old names momentum and adam are accepted). `devices=` is the
    old name of `gpus` and still accepted."""
    from hybridpar.search.placer import place_model

    gpus = options.pop("devices", gpus)
    return place_model(_model_arg(model, example_inputs), cluster, gpus, config, **options)


def with_placement(plan_: Plan, module: nn.Module, *, time_limit_s: float = PLACER_TIME_LIMIT_S,
                   optimizer: str = "sgd", momentum: float = 0.0, example_inputs: tuple | None = None,
                   micro_batches: int | None = None, time_chunks: int | None = None,
                   schedule: str | None = None) -> Plan:
    """`plan_` with its placement filled in before any rank starts (unchanged when it has one, or when
    mp == 1): DLPlacer's for the plan's model, cluster and per-replica batch. The ranks never search.
    `optimizer`/`momentum`: the run's, as `train` takes them (its state in memory, its update in the step);
    `example_inputs`: at one forward's batch, for a model the runtime runs on torch.export's graph;
    `micro_batches`: the run's GPipe count (priced), None: the placer chooses it (Plan.micro_batches);
    `time_chunks`: the run's recurrent time chunks (priced as the wavefront runs; None: whole layers);
    `schedule`: the run's micro-batch schedule (gpipe | 1f1b), None: the placer chooses it with the count."""
    if plan_.placement is not None or plan_.mp == 1:
        return plan_
    from hybridpar.search.placer import place_model
    from hybridpar.search.placer.module_placement import placement_from_outcome

    shape = tuple(plan_.input_shape) if plan_.input_shape else None
    outcome = place_model(plan_.model, plan_.cluster, plan_.mp, batch=max(1, plan_.batch // plan_.dp),
                          input_shape=shape, time_limit_s=time_limit_s, optimizer=optimizer, momentum=momentum,
                          micro_batches=micro_batches, time_chunks=time_chunks, schedule=schedule)
    return plan_.model_copy(update={"placement": placement_from_outcome(outcome, module, example_inputs),
                                    "micro_batches": outcome.plan.micro_batches, "schedule": outcome.plan.schedule,
                                    "time_chunks": outcome.plan.time_chunks})


@dataclasses.dataclass(frozen=True)
class ProjectConfig:
    """What `project` sweeps and how it prices each point (the CLI's flags, one field each)."""

    mp_degrees: tuple[int, ...] = (2, 4, 8)
    batch_per_gpu: int | None = None  # default: per model (docs/convergence.md)
    curve_path: str | None = None  # a measured curve (measure-convergence --out); default: built in
    samples_per_epoch: int | None = None
    placer: str = "ilp"
    placer_time_limit_s: float = 3.0
    time_chunks: int | bool | None = None  # DPxMP's recurrent time chunks K (None: the placer's; 1: whole)
    cf_max_gpus: int = 32
    dtype: str = "fp32"
    budget: int | None = None  # also choose batch/DP/MP jointly for this many GPUs
    batch_options: tuple[int, ...] = (16, 32, 64, 128, 256)
    use_disk_cache: bool = True


@dataclasses.dataclass(frozen=True)
class ProjectResult:
    projection: Any  # hybridpar.search.projection.Projection
    sensitivity: dict
    joint: Any  # hybridpar.search.projection.joint.JointChoice | None
    time_chunks: int | bool | None

    def to_dict(self) -> dict:
        out = self.projection.to_dict()
        out["time_chunks"] = self.time_chunks  # as asked (None: the placer's choice; the notes say which)
        out["sensitivity"] = self.sensitivity
        out["joint"] = self.joint.to_dict() if self.joint else None
        return out


def project(model: str, cluster=DEFAULT_CLUSTER, gpus: Sequence[int] = tuple(2**i for i in range(13)),
            config: ProjectConfig | None = None, *, progress: Callable[[str], None] | None = None) -> ProjectResult:
    """End-to-end time to target and speedup over one GPU for DP, hybrid DPxMP and channel/filter
    layouts at each device count in `gpus` (Pal et al. 2019's projection), with the sensitivity to the
    convergence curve's band and, with `config.budget`, the joint batch/DP/MP choice."""
    from hybridpar.convergence.builtin import builtin_curve, load_curve
    from hybridpar.search.budget import check_projection
    from hybridpar.search.placer import SOLVERS
    from hybridpar.search.projection import band_sensitivity, default_batch_per_gpu
    from hybridpar.search.projection import project as _project
    from hybridpar.search.projection.costs import CostModelBackend

    cfg = config or ProjectConfig()
    if cfg.placer not in SOLVERS:
        raise UserError(f"--placer {cfg.placer!r}: choose one of {', '.join(SOLVERS)}")
    if cfg.placer_time_limit_s <= 0:
        raise UserError("--placer-time-limit must be > 0")
    if cfg.samples_per_epoch is not None and cfg.samples_per_epoch < 1:
        raise UserError("--samples-per-epoch must be >= 1")
    b = cfg.batch_per_gpu if cfg.batch_per_gpu is not None else default_batch_per_gpu(model)
    if b < 1:
        raise UserError(f"--batch-per-gpu must be >= 1, got {b}")
    if cfg.budget is not None and cfg.budget < 1:
        raise UserError(f"--budget must be >= 1 GPU, got {cfg.budget}")
    counts, mps = list(gpus), list(cfg.mp_degrees)
    curve = load_curve(cfg.curve_path, model) if cfg.curve_path else builtin_curve(model)
    if cfg.samples_per_epoch:
        curve = dataclasses.replace(curve, samples_per_epoch=float(cfg.samples_per_epoch))
    check_projection(counts, mps)  # before any pricing: a refusal is one line
    costs = CostModelBackend(model, cluster, dtype=cfg.dtype, placer_solver=cfg.placer,
                             placer_time_limit_s=cfg.placer_time_limit_s, cf_max_gpus=cfg.cf_max_gpus,
                             use_disk_cache=cfg.use_disk_cache, time_chunks=cfg.time_chunks)
    step = progress or (lambda _msg: None)
    kw: dict[str, Any] = {"model": model, "cluster": cluster, "mp_degrees": mps}
    proj = _project(costs, curve, counts, b, progress=step, **kw)
    sens = band_sensitivity(costs, curve, counts, b, **kw)
    joint = None
    if cfg.budget is not None:
        from hybridpar.search.projection.joint import choose

        joint = choose(costs, curve, cfg.budget, batch_options=list(cfg.batch_options), mp_degrees=mps,
                       progress=step)
    proj = dataclasses.replace(proj, notes=(*proj.notes, *costs.notes))
    return ProjectResult(proj, sens, joint, cfg.time_chunks)
