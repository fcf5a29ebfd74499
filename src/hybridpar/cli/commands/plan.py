"""`hybridpar plan`: per-layer sample/channel/filter decomposition (Dryden et al. SC19)."""

from __future__ import annotations

import re
from dataclasses import asdict

import click

from hybridpar.cli.options import POSITIVE_FLOAT, batch_option, cluster_option, gpus_option
from hybridpar.cli.output import console, err_console, human_bytes, print_json, table, time_columns
from hybridpar.errors import UserError

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str | None) -> float | None:
    """'16GiB', '16 GB', '1.5e9' -> bytes."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise UserError(f"--memory-limit {text!r}: expected bytes or a size like 16GiB / 12GB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise UserError(f"--memory-limit {text!r} must be positive")
    return value


def _baseline_json(pred) -> dict | None:
    return None if pred is None else {
        "step_time_s": pred.step_time_s, "comm_s": pred.comm_s, "exposed_comm_s": pred.exposed_comm_s,
        "memory_bytes_per_device": pred.memory_bytes[0] if pred.memory_bytes else 0}


def _result_json(res) -> dict:
    base = res.baseline
    fsdp_brk = getattr(res, "fsdp_breakdown", None)
    return {
        "plan": res.plan.model_dump(),
        "method": res.method,
        "solve_s": res.solve_s,
        "predicted": res.prediction.model_dump(exclude={"memory_bytes"}) | {
            "memory_bytes_per_device": res.prediction.memory_bytes[0] if res.prediction.memory_bytes else 0},
        "data_parallel": None if base is None else {
            "step_time_s": base.step_time_s, "comm_s": base.comm_s, "exposed_comm_s": base.exposed_comm_s,
            "memory_bytes_per_device": base.memory_bytes[0] if base.memory_bytes else 0},
        "data_parallel_note": res.baseline_note,
        "breakdown": None if res.breakdown is None else asdict(res.breakdown),
        "data_parallel_breakdown": None if res.baseline_breakdown is None else asdict(res.baseline_breakdown),
        "speedup_vs_dp": res.speedup_vs_dp,
        # the note saying which op times are the roofline's, not measured here (localhost), else None
        "uncalibrated_estimate": _uncalibrated(res.plan),
        # --channels-last: how the plan priced the format (Plan.channels_last) and its note; None: NCHW
        "channels_last": res.plan.channels_last,
        "channels_last_note": _format_note(res.plan),
        # the second baseline: FSDP (sample=N,zero=3) with every block recomputed (torchtitan's default)
        "fsdp_recompute": _baseline_json(res.fsdp_baseline),
        "fsdp_recompute_note": res.fsdp_note,
        "fsdp_recompute_breakdown": None if fsdp_brk is None else asdict(fsdp_brk),
        "speedup_vs_fsdp_recompute": res.speedup_vs_fsdp,
        "layers": [{"name": r.name, "module": r.module, "op": r.op, "choice": r.choice,
                    "algorithm": r.algorithm,
                    "compute_s": r.cost.fwd_s + r.cost.bwd_s, "comm_s": r.cost.comm_fwd_s + r.cost.comm_bwd_s,
                    "grad_sync_s": r.cost.grad_sync_s, "memory_bytes": r.cost.memory_bytes} for r in res.layers],
        "pruned": {k: [{"layout": p.layout.to_strategy(), "reason": p.reason} for p in v]
                   for k, v in res.pruned.items()},
        # every parameterised module (weight layers, norms, embeddings, recurrent and attention layers,
        # free parameters): allreduce_bytes sum to breakdown.grad_bytes
        "parameters": [g.as_dict() for g in res.gradients],
        # spatial splits (issue 30): the best spatial layout against the best plan without them, whether
        # the plan goes spatial and why (time, memory) or not (slower, over the memory limit); None: not compared
        "spatial": getattr(res, "spatial", None),
    }


def _uncalibrated(plan) -> str | None:
    from hybridpar.cost.coverage import LABEL

    return next((n for n in plan.notes if n.startswith(LABEL)), None)


def _format_note(plan) -> str | None:
    from hybridpar.search.layers.uncalibrated import CL_NOTE

    return next((n for n in plan.notes if n.startswith(CL_NOTE)), None)


def _short(choice: str) -> str:
    return " ".join(part.replace("sample=", "s").replace("channel=", "c").replace("filter=", "f")
                    for part in choice.split(","))


def _print(res, gpus: int) -> None:
    shown = [r for r in res.layers if r.layout is not None]
    (compute_h, compute), (comm_h, comm) = time_columns(
        ["compute", "comm"], [[r.cost.fwd_s + r.cost.bwd_s for r in shown],
                              [r.cost.comm_fwd_s + r.cost.comm_bwd_s for r in shown]], same_unit=True)
    rows = [[r.module or r.name, _short(r.choice), r.algorithm, t, c, human_bytes(r.cost.memory_bytes)]
            for r, t, c in zip(shown, compute, comm)]
    p = res.plan
    tag = " (UNCALIBRATED ESTIMATE: see the note below)" if _uncalibrated(p) else ""
    console.print(table(f"{p.model} on {gpus} x {p.cluster}, batch {p.batch}: {res.method}{tag}",
                        ["layer", "layout", "algorithm", compute_h, comm_h, "memory"], rows,
                        justify_right=lambda c: c not in ("layer", "layout", "algorithm")))
    pr, base, fsdp = res.prediction, res.baseline, res.fsdp_baseline
    named = [(name, q) for name, q in (("plan", pr), ("data parallel", base), (FSDP_ROW, fsdp)) if q is not None]
    kinds = ("step_time_s", "compute_s", "comm_s", "exposed_comm_s")
    cols = time_columns(["time", "compute", "comm", "exposed"],
                        [[getattr(q, k) for _, q in named] for k in kinds], same_unit=True)
    summary = [[name, *(col[1][i] for col in cols), human_bytes(q.memory_bytes[0])]
               for i, (name, q) in enumerate(named)]
    console.print(table(f"predicted{tag}", ["per step", *(c[0] for c in cols), "memory"], summary,
                        justify_right=lambda c: c != "per step"))
    for label, q, speedup, note, prefix in (
            ("data parallelism", base, res.speedup_vs_dp, res.baseline_note, "data parallelism"),
            (FSDP_NAME, fsdp, res.speedup_vs_fsdp, res.fsdp_note, FSDP_NAME)):
        if q is not None:
            console.print(f"speedup over {label}: [bold]{speedup:.2f}x[/bold] "
                          f"({_rate(p.batch / pr.step_time_s)} vs {_rate(p.batch / q.step_time_s)} samples/s), "
                          f"memory {_memory_ratio(pr, q)}")
        else:
            note = note or "not evaluated"
            console.print(note if note.startswith(prefix) else f"{label}: {note}")
    for n in dict.fromkeys(p.notes):  # each once, and not the baseline's note again
        # the baselines' figures are printed above (the note is for the plan file and its report)
        if n not in (res.baseline_note, res.fsdp_note) and not n.startswith("against the baselines: "):
            console.print(f"note: {n}")


FSDP_NAME = "FSDP + full recomputation"
FSDP_ROW = "FSDP + recompute"


def _memory_ratio(pr, q) -> str:
    """The plan's memory per device against a baseline's."""
    a, b = pr.memory_bytes[0], q.memory_bytes[0]
    return f"{human_bytes(a)} vs {human_bytes(b)} per device ({a / b:.2f}x)" if b else f"{human_bytes(a)}"


def register(app: click.Group) -> None:
    @app.command("plan")
    @click.option("--model", required=True, help="zoo name or path/to/file.py:factory")
    @cluster_option()
    @gpus_option(help="devices (world size) the plan is for")
    @batch_option()
    @click.option("--memory-limit", default=None, help="bytes per device (e.g. 16GiB); default: device memory")
    @click.option("--strategy", default=None, help="evaluate this uniform layout (e.g. sample=2,channel=2)")
    @click.option("--dtype", default="fp32", type=click.Choice(["fp32", "fp16", "bf16", "tf32"]),
                  show_default=True)
    @click.option("--input-shape", default=None, help="per-sample input shape C,H,W for file models")
    @click.option("--grad-sync", type=click.Choice(["buckets", "flat", "overlap"]), default="buckets",
                  show_default=True,
                  help="buckets: 4 MiB gradient buckets allreduced while backward goes on (hybridpar train); "
                       "flat: one gradient allreduce after backward; overlap: per layer, overlapping backward")
    @click.option("--free-sample", is_flag=True,
                  help="let each layer pick its own sample degree (redistribution between; projection only)")
    @click.option("--time-share", type=POSITIVE_FLOAT, default=None,
                  help="measured slowdown of each rank's compute with all ranks running (default: the "
                       "cluster's; on localhost ranks/cores)")
    @click.option("--optimizer", type=click.Choice(["sgd", "adamw", "lars"]), default="sgd", show_default=True,
                  help="what the run steps with, as `hybridpar train --optimizer` takes it: its state in each "
                       "device's memory and its update in the step")
    @click.option("--momentum", type=float, default=0.0, show_default=True,
                  help="as `train --momentum` (SGD keeps a momentum buffer when > 0)")
    @click.option("--weight-decay", type=float, default=0.0, show_default=True, help="as `train --weight-decay`")
    @click.option("--recompute", type=click.Choice(["auto", "none", "all"]), default="auto", show_default=True,
                  help="activation recomputation: auto = the planner weighs it (with zero=2|3, the sample "
                       "dimension's parameters sharded) when data parallelism does not fit the memory limit; "
                       "none | all fix it (as `train --recompute`)")
    @click.option("--dry-run/--no-dry-run", "dry", default=None,
                  help="run the planned layout on meta tensors first (hybridpar.parallel.check): refuse ops it "
                       "cannot serve, and price DTensor's redistributions between layers (default: on for "
                       "file models, whose code between layers may mix channels; off for the zoo); "
                       "--no-dry-run also prices layouts the runtime cannot run (a what-if)")
    @click.option("--channels-last", is_flag=True, default=False,
                  help="price 4-D ops in channels-last (NHWC) memory, as `train --channels-last` runs them: from "
                       "the channels-last op times `hybridpar profile --channels-last` measured on localhost, "
                       "else as NCHW (the notes say which); a flatten of a 4-D activation as the copy it is")
    @click.option("--out", "out", default=None, type=click.Path(dir_okay=False), help="write the Plan JSON")
    @click.option("--json", "json_", is_flag=True, help="machine-readable output")
    def plan_cmd(model, cluster, gpus, batch, memory_limit, strategy, dtype, input_shape, grad_sync,  # noqa: PLR0913
                 free_sample, time_share, optimizer, momentum, weight_decay, recompute, dry, channels_last, out,
                 json_) -> None:
        """Choose a sample/channel/filter decomposition per layer (or evaluate --strategy)."""
        from hybridpar.api import plan

        limit = parse_bytes(memory_limit)
        shape = None
        if input_shape:  # graph.models imports torch: only a file model's shape needs it (zoo graphs are cached)
            from hybridpar.graph.models import parse_shape

            shape = parse_shape(input_shape)
        status = None if json_ else err_console.status("planning", spinner="dots")
        if status is not None:
            status.start()
        try:
            res = plan(model, cluster, gpus, batch, memory_limit=limit, strategy=strategy, dtype=dtype,
                       input_shape=shape, grad_sync=grad_sync, free_sample=free_sample, time_share=time_share,
                       dry_run=dry, optimizer=optimizer, momentum=momentum, weight_decay=weight_decay,
                       recompute=recompute, channels_last=channels_last,
                       progress=None if status is None else (lambda msg: status.update(msg)))
        finally:
            if status is not None:
                status.stop()
        if out:
            res.plan.save(out)
        if json_:
            print_json(_result_json(res))
            return
        _print(res, gpus)
        if out:
            model_arg = f" --model {model}" if ":" in model else ""  # a file model is code: train asks for it again
            console.print(f"plan written to {out} (run it: hybridpar train --plan {out}{model_arg})")


def _rate(per_s: float) -> str:
    """Samples per second with three significant figures below 100 (a 35 s step is 0.229, not 0)."""
    return f"{per_s:,.0f}" if per_s >= 100 else f"{per_s:.3g}"
