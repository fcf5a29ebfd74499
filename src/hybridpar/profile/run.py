"""`run_profile`: measure this machine and write the calibration file."""

from __future__ import annotations

import datetime as _dt
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from hybridpar.cluster.calibration import (
    Calibration,
    CollectiveFit,
    GlooFit,
    LayoutStep,
    OpRecord,
    ProcessDraw,
    RuntimeOverhead,
    StepFit,
    default_calibration_path,
    load_calibration,
    model_key,
    save_calibration,
)
from hybridpar.errors import UserError
from hybridpar.profile.gloo import DEFAULT_SIZES, fit_alpha_beta, fit_collective, measure_collectives
from hybridpar.profile.gloo_worker import KINDS

Progress = Callable[[str, int], None]  # (description of the step starting, total steps)
# fresh sets of lockstep workers at each of four points of a profile (profile.rank_skew.SkewSampler)
SKEW_LAUNCHES_PER_POINT = 2


@dataclass(frozen=True)
class ProfileOptions:
    ranks: tuple[int, ...] = (2, 4)
    sizes: tuple[int, ...] = DEFAULT_SIZES
    model: str | None = "small_cnn"
    batch: int = 32
    input_shape: tuple[int, ...] | None = None
    splits: tuple[int, ...] = (1,)
    warmup: int = 2
    repeats: int = 10
    merge: bool = True  # keep op records and gloo fits of an existing file that this run does not redo
    # the runtime's own overhead is a property of the machine and the runtime, not of the model: kept
    # from an existing file (same host, same torch) unless this is set or the file has none
    remeasure_overhead: bool = False
    # also time the model's 4-D ops in channels-last memory (records under their own names, beside NCHW's)
    channels_last: bool = False
    # "bf16": also time every op as a bf16 autocast step runs it (`train --precision bf16`)
    precision: str = "fp32"

    @property
    def formats(self) -> tuple[tuple[str, str], ...]:
        """(memory format, precision) of each set of op records to time: NCHW fp32 always."""
        mfs = ("nchw", "channels_last") if self.channels_last else ("nchw",)
        precs = ("fp32", "bf16") if self.precision == "bf16" else ("fp32",)
        return tuple((mf, p) for p in precs for mf in mfs)

    def validate(self) -> None:
        if not self.ranks or any(r < 2 or r > 64 for r in self.ranks):
            raise UserError(f"ranks: each rank count must be in 2..64, got {list(self.ranks)}", param="ranks")
        if not self.sizes or any(s < 4 for s in self.sizes) or len(set(self.sizes)) < 2:
            raise UserError("sizes: need at least two different sizes of >= 4 bytes to fit alpha and beta",
                            param="sizes")
        if self.batch < 1:
            raise UserError(f"batch must be >= 1, got {self.batch}", param="batch")
        if self.repeats < 1:
            raise UserError(f"repeats must be >= 1, got {self.repeats}", param="repeats")
        if self.warmup < 0:
            raise UserError(f"warmup must be >= 0, got {self.warmup}", param="warmup")
        if any(k < 1 for k in self.splits):
            raise UserError(f"splits must be positive integers, got {list(self.splits)}", param="splits")
        if self.channels_last and not self.model:
            raise UserError("channels_last times a model's 4-D ops: it needs a model", param="channels_last")
        if self.precision not in ("fp32", "bf16"):
            raise UserError(f"precision must be fp32 or bf16 (autocast), got {self.precision!r}", param="precision")
        if self.precision == "bf16" and not self.model:
            raise UserError("precision bf16 times a model's ops under autocast: it needs a model", param="precision")


def op_specs(opts: ProfileOptions) -> list:
    """The shapes of the module kinds `profile.ops` times for `opts.model`, and with `channels_last`
    the 4-D ones again in that format (UserError for a bad model spec, or `channels_last` on a model
    with no 4-D op of those kinds)."""
    if not opts.model:
        return []
    from hybridpar.graph.models import load_model
    from hybridpar.profile import ops

    loaded = load_model(opts.model, batch=opts.batch, input_shape=opts.input_shape)
    specs = []
    for prec in dict.fromkeys(p for _, p in opts.formats):
        found = ops.collect_op_specs(loaded.module, loaded.example_inputs, prec)
        specs += ops.split_variants(found, opts.splits) + ops.model_nhwc_variants(found, opts.splits)
    if not opts.channels_last:
        return specs
    cl = ops.channels_last_variants(specs)
    if not cl:
        raise UserError(f"channels_last: model {opts.model!r} has no 4-D (image) convolution, norm or pooling "
                        "to time in that format", param="channels_last")
    return list({s.key: s for s in specs + cl}.values())  # a model-NHWC record is its channels-last one


def graph_work(opts: ProfileOptions, covered: set[str]):
    """(module, example inputs, graph, jobs) of the ops of `opts.model`'s graph that the hook path
    (`op_specs`) does not time: every other op kind and shape (profile.graph_ops); None without a model."""
    if not opts.model:
        return None
    from hybridpar.graph import trace
    from hybridpar.graph.models import load_model
    from hybridpar.profile.graph_ops import graph_jobs

    loaded = load_model(opts.model, batch=opts.batch, input_shape=opts.input_shape)
    try:
        graph = trace(loaded.module, loaded.example_inputs, train=True)
    except UserError:
        return None  # a model the planner cannot trace either: its plan fails first, with the reason
    return loaded.module, loaded.example_inputs, graph, graph_jobs(graph, opts.splits, covered, opts.formats)


def model_ops(opts: ProfileOptions, step: Callable[[str], None] | None = None
              ) -> tuple[dict[str, OpRecord], dict[str, str]]:
    """Only the op records of `opts.model` (both paths, every format and precision asked for), without the
    device figures and gloo runs of `run_profile`: (records by key, untimed key -> reason)."""
    opts.validate()
    import torch

    specs = op_specs(opts)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank = one core: measure what one rank gets
    try:
        return _model_ops(opts, specs, graph_work(opts, {s.key for s in specs}), step or (lambda _desc: None))
    finally:
        torch.set_num_threads(threads)


def _model_ops(opts: ProfileOptions, specs: list, work, step: Callable[[str], None]
               ) -> tuple[dict[str, OpRecord], dict[str, str]]:
    """The hook path's op records (profile.ops), then every other op of the graph (profile.graph_ops):
    records by key, and the keys that could not be timed with the reason."""
    from hybridpar.profile import ops

    records: dict[str, OpRecord] = {}
    for s in specs:
        step(f"{s.record_op} {'x'.join(map(str, s.x))}")
        rec = ops.profile_op(s, warmup=opts.warmup, repeats=max(3, opts.repeats // 2))
        records[rec.key] = rec
    if not work:
        return records, {}
    from hybridpar.profile.graph_ops import profile_graph_ops

    module, inputs, graph, _ = work
    got, untimed = profile_graph_ops(module, inputs, graph, opts.splits, set(records), warmup=opts.warmup,
                                     repeats=max(3, opts.repeats // 2), progress=step,
                                     formats=opts.formats)
    return {**records, **got}, untimed


def device_figures(*, warmup: int = 2, repeats: int = 10) -> dict:
    """One rank's single-thread matmul peaks (fp32, bf16), matmul rate by size and copy bandwidth:
    the Calibration fields that describe the device (seconds, not the gloo runs)."""
    import torch

    from hybridpar.profile import ops

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank = one core: measure what one rank gets
    try:
        peak, mm = ops.matmul_peak(warmup=warmup, repeats=repeats)
        peak_bf16, mm_bf16 = ops.bf16_matmul_peak(warmup=warmup, repeats=repeats)
        bw, _ = ops.copy_bandwidth(warmup=warmup, repeats=repeats)
        curve = ops.matmul_curve(warmup=warmup, repeats=repeats)
    finally:
        torch.set_num_threads(threads)
    return {"peak_flops_fp32": peak, "matmul": mm, "peak_flops_bf16": peak_bf16, "matmul_bf16": mm_bf16,
            "mem_bw_Bps": bw, "matmul_curve": curve}


def run_profile(opts: ProfileOptions, out: str | os.PathLike | None = None,
                progress: Progress | None = None, specs: list | None = None) -> tuple[Calibration, Path]:
    """Measure matmul peak, copy bandwidth, the model's op times and gloo collectives (every kind the
    runtime issues, in groups of every size that divides each world size), and the runtime's own
    overhead unless the file holds it (`overhead_to_keep`); write the file."""
    opts.validate()
    import torch

    from hybridpar.cluster.localhost import physical_cores

    torch.set_num_threads(1)  # one rank = one core: measure what one rank gets
    if specs is None:
        specs = op_specs(opts)
    dist_layers = bool(opts.model) and any(k > 1 for k in opts.splits)
    path = calibration_path(out)
    overhead = overhead_to_keep(opts, path)
    work = graph_work(opts, {s.key for s in specs})
    n_graph = len(work[3]) if work else 0
    total = 5 + len(specs) + n_graph + len(opts.ranks) + 2 * int(dist_layers) + int(overhead is None)
    step = progress or (lambda desc, total: None)

    from hybridpar.profile.rank_skew import SkewSampler

    # the rank skew's launches spread over the profile, at the moments the figures it stretches are timed
    skew = SkewSampler(opts.ranks)
    step("matmul peaks and copy bandwidth", total)
    device = device_figures(warmup=opts.warmup, repeats=opts.repeats)
    skew.sample(SKEW_LAUNCHES_PER_POINT)
    records, untimed = _model_ops(opts, specs, work, lambda desc: step(desc, total))
    timed_here = set(records)  # (the dist layers below are timed in processes of their own)
    skew.sample(SKEW_LAUNCHES_PER_POINT)
    steps_run = _dist_layers(opts, records, lambda desc: step(desc, total)) if dist_layers else None
    fits: dict[int, GlooFit] = {}
    colls: list[CollectiveFit] = []
    for p in opts.ranks:
        step(f"gloo collectives, {p} ranks", total)
        groups = [g for g in range(2, p + 1) if p % g == 0]
        measured = measure_collectives(p, opts.sizes, KINDS, groups, warmup=opts.warmup, repeats=opts.repeats,
                                       timeout_s=600.0)
        fits[p] = fit_alpha_beta(p, opts.sizes, measured[("allreduce", p)])
        colls += [fit_collective(kind, p, g, opts.sizes, times) for (kind, g), times in measured.items()]
    skew.sample(SKEW_LAUNCHES_PER_POINT)

    step("framework memory", total)
    from hybridpar.profile.framework_memory import measure_framework_bytes

    framework = measure_framework_bytes(min(opts.ranks))
    step("model-parallel executor overhead", total)
    from hybridpar.profile.executor import mp_node_overhead_s

    node_overhead = mp_node_overhead_s()
    step("optimizer step, finiteness check and loss", total)
    from hybridpar.profile.update import measure_update

    per_step = measure_update(warmup=opts.warmup, repeats=max(5, opts.repeats))
    step("ranks in lockstep against one process", total)
    skew.sample(SKEW_LAUNCHES_PER_POINT)
    if overhead is None:
        step("channel/filter runtime overhead", total)
        from hybridpar.profile.runtime_overhead import runtime_overhead

        rt = runtime_overhead()
        overhead = RuntimeOverhead(**{f"{k[:-2]}_{part}_s": rt[k][i]
                                      for k in ("sample_node_s", "dtensor_node_s", "layer_s", "spatial_op_s")
                                      for i, part in enumerate(("fwd", "bwd"))},
                                   redistribute_s=rt.get("redistribute_s"))
    records, draw = _as_fresh_process(records, timed_here, skew)
    old = _previous(path) if opts.merge else None
    steps, skipped = _layout_steps(opts, steps_run, old)
    if old is not None:
        untimed = {k: v for k, v in {**old.untimed, **untimed}.items() if k not in records}
        records = {**old.ops, **records}
        fits = {**old.gloo, **fits}
        colls = [f for f in old.collectives if f.world_size not in opts.ranks] + colls
    cal = Calibration(created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                      hostname=platform.node(), cpu_count=physical_cores(), torch_version=torch.__version__,
                      threads_per_rank=1, **device, gloo=fits,
                      collectives=colls, ops=records, framework_bytes=framework,
                      mp_node_overhead_s=node_overhead, runtime_overhead=overhead,
                      update={k: StepFit(**v) for k, v in per_step["update"].items()},
                      guard={k: StepFit(**v) for k, v in per_step["guard"].items()},
                      loss=StepFit(**per_step["loss"]), rank_skew=skew.result(), process_draw=draw,
                      untimed=untimed, layout_steps=steps, layout_steps_skipped=skipped)
    return cal, save_calibration(cal, path)


def _dist_layers(opts: ProfileOptions, records: dict, step: Callable[[str], None]) -> dict:
    """The model's split layers as the runtime runs them (into `records`), then its step under each
    sample and channel/filter layout on a fake world (hybridpar.profile.layout_steps: returned, unscaled)."""
    step("channel/filter layers as the runtime runs them")
    from hybridpar.profile.dist_layers import measure_dist_layers
    from hybridpar.profile.layout_steps import layout_steps

    # the model's layers at full shape (specs holds them at every split's local shape too)
    whole = op_specs(replace(opts, splits=(1,), channels_last=False, precision="fp32"))
    records.update(measure_dist_layers(whole, opts.splits, warmup=opts.warmup, repeats=max(3, opts.repeats // 2)))
    step("the model's step under each sample and channel/filter layout on a fake world")
    assert opts.model is not None  # dist layers need one
    return layout_steps(opts.model, opts.batch, opts.input_shape, opts.splits)


def _layout_steps(opts: ProfileOptions, run: dict | None,
                  old: Calibration | None = None) -> tuple[list[LayoutStep], dict[str, str]]:
    """The fake-world steps (hybridpar.profile.layout_steps) as measured, and the layouts the runtime
    could not run, with why; merged into `old`'s (this profile's replace them). Not scaled by the
    process draw as the op table is: the subprocess is itself a fresh process, one draw as each rank
    is, and the scale was noise here: four fresh subprocesses timed CosmoFlow's `sample=2` step at
    163-170 ms while the fresh workers' reference over the subprocess's moved the filed figure by 4-19%
    between profile calls (2026-12-05)."""
    steps: list[LayoutStep] = []
    skipped: dict[str, str] = {}
    if run:
        shape = list(opts.input_shape) if opts.input_shape else None
        model = model_key(opts.model or "")
        # filed under the shape the model ran at (its own, when the profile was given none): the
        # planner looks them up under the shape it traced, and a plan file holds that shape
        steps = [LayoutStep(model=model, batch=opts.batch, input_shape=r.get("input_shape") or shape,
                            world_size=r["world_size"],
                            layout=r["layout"], **{k: r[k] for k in ("step_s", "collectives_s",
                                                                      "redistributions_s", "rest_s")})
                 for r in run["steps"]]
        skipped = {f"{model} | {lay}": why for lay, why in run.get("skipped", {}).items()}
    if old is not None:
        mine = {st.key() for st in steps}
        steps = [st for st in old.layout_steps if st.key() not in mine] + steps
        this_model = f"{model_key(opts.model or '')} | "
        skipped = {k: v for k, v in old.layout_steps_skipped.items() if not (run and k.startswith(this_model))} \
            | skipped
    return steps, skipped


def _as_fresh_process(records: dict[str, OpRecord], timed_here: set[str], skew) -> tuple[dict, ProcessDraw | None]:
    """The records this process timed at a fresh process's speed: the op table is one process's speed
    draw, the ranks it prices are fresh processes (cluster.calibration.ProcessDraw)."""
    draw = skew.draw()
    if draw is None:
        return records, None
    return {k: r.scaled(draw.scale) if k in timed_here else r for k, r in records.items()}, draw


def calibration_path(out: str | os.PathLike | None = None) -> Path:
    return Path(out).expanduser() if out is not None else default_calibration_path()


def overhead_to_keep(opts: ProfileOptions, path: Path) -> RuntimeOverhead | None:
    """The runtime overhead already in the calibration file at `path`, which `run_profile` keeps rather
    than measure again: it is a property of the machine and the runtime, not of the model (~10 s to
    measure). None, so measured, with `remeasure_overhead`, without merging (the file is replaced), when
    the file has none, or when it was written on another host or with another torch."""
    import torch

    old = None if opts.remeasure_overhead or not opts.merge else _previous(path)
    if old is None or old.runtime_overhead is None or old.runtime_overhead.redistribute_s is None:
        return None  # none, or one measured before the redistributions were
    if old.hostname != platform.node() or old.torch_version != torch.__version__:
        return None
    return old.runtime_overhead


def _previous(path: Path) -> Calibration | None:
    try:
        return load_calibration(path)
    except UserError:
        return None  # an unreadable old file is simply replaced


def sizes_default() -> Sequence[int]:
    return DEFAULT_SIZES
