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


def _result_json(res) -> dict:
    base = res.baseline
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
        "layers": [{"name": r.name, "module": r.module, "op": r.op, "choice": r.choice,
                    "algorithm": r.algorithm,
                    "compute_s": r.cost.fwd_s + r.cost.bwd_s, "comm_s": r.cost.comm_fwd_s + r.cost.comm_bwd_s,
                    "grad_sync_s": r.cost.grad_sync_s, "memory_bytes": r.cost.memory_bytes} for r in res.layers],
        "pruned": {k: [{"layout": p.layout.to_strategy(), "reason": p.reason} for p in v]
                   for k, v in res.pruned.items()},
        # every parameterised module (weight layers, norms, embeddings, recurrent and attention layers,
        # free parameters): allreduce_bytes sum to breakdown.grad_bytes
        "parameters": [g.as_dict() for g in res.gradients],
    }


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
    console.print(table(f"{p.model} on {gpus} x {p.cluster}, batch {p.batch}: {res.method}",
                        ["layer", "layout", "algorithm", compute_h, comm_h, "memory"], rows,
                        justify_right=lambda c: c not in ("layer", "layout", "algorithm")))
    pr, base = res.prediction, res.baseline
    preds = [pr] if base is None else [pr, base]
    kinds = ("step_time_s", "compute_s", "comm_s", "exposed_comm_s")
    cols = time_columns(["time", "compute", "comm", "exposed"], [[getattr(q, k) for q in preds] for k in kinds],
                        same_unit=True)
    summary = [[name, *(col[1][i] for col in cols), human_bytes(q.memory_bytes[0])]
               for i, (name, q) in enumerate(zip(("plan", "data parallel"), preds))]
    console.print(table("predicted", ["per step", *(c[0] for c in cols), "memory"], summary,
                        justify_right=lambda c: c != "per step"))
    if base is not None:
        console.print(f"speedup over data parallelism: [bold]{res.speedup_vs_dp:.2f}x[/bold] "
                      f"({p.batch / pr.step_time_s:,.0f} vs {p.batch / base.step_time_s:,.0f} samples/s)")
    else:
        note = res.baseline_note or "not evaluated"
        console.print(note if note.startswith("data parallelism") else f"data parallelism: {note}")
    for n in dict.fromkeys(p.notes):  # each once, and not the baseline's note again
        if n != res.baseline_note:
            console.print(f"note: {n}")


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
    @click.option("--dry-run/--no-dry-run", "dry", default=None,
                  help="run the planned layout on meta tensors first (hybridpar.parallel.check): refuse ops it "
                       "cannot serve, and price DTensor's redistributions between layers (default: on for "
                       "file models, whose code between layers may mix channels; off for the zoo); "
                       "--no-dry-run also prices layouts the runtime cannot run (a what-if)")
    @click.option("--out", "out", default=None, type=click.Path(dir_okay=False), help="write the Plan JSON")
    @click.option("--json", "json_", is_flag=True, help="machine-readable output")
    def plan_cmd(model, cluster, gpus, batch, memory_limit, strategy, dtype, input_shape, grad_sync,  # noqa: PLR0913
                 free_sample, time_share, optimizer, momentum, weight_decay, dry, out, json_) -> None:
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
            console.print(f"plan written to {out} (run it: hybridpar train --plan {out})")
