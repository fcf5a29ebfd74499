"""`hybridpar profile`: measure this machine and write the calibration file for `localhost`."""

from __future__ import annotations

import os

import click

from hybridpar.cli.output import console, err_console, print_json, table
from hybridpar.cli.parsing import parse_int_list


def register(app: click.Group) -> None:
    @app.command("profile")
    @click.option("--out", default=None, metavar="PATH",
                  help="calibration file (default $HYBRIDPAR_CALIBRATION or ~/.cache/hybridpar/calibration.json)")
    @click.option("--ranks", default="2,4", show_default=True, help="gloo world sizes to measure")
    @click.option("--model", default="small_cnn", show_default=True,
                  help="profile every op kind and shape of this model's graph (zoo name or file.py:factory; '' for "
                       "none); ops that cannot be timed are listed in the file and in plans' notes")
    @click.option("--batch", type=int, default=32, show_default=True)
    @click.option("--input-shape", default=None, help="C,H,W for a factory model")
    @click.option("--splits", default="1", show_default=True,
                  help="also profile each op at 1/k of samples, channels and filters for each k")
    @click.option("--sizes", default=None, help="collective sizes in bytes, e.g. 4K,64K,1M (default 4K..4M)")
    @click.option("--repeats", type=int, default=10, show_default=True)
    @click.option("--warmup", type=int, default=2, show_default=True)
    @click.option("--no-merge", is_flag=True, help="replace the file instead of merging with it")
    @click.option("--remeasure-overhead", is_flag=True,
                  help="measure the runtime's own overhead again (else kept from the file once measured on "
                       "this host and torch: it does not depend on the model)")
    @click.option("--channels-last", is_flag=True,
                  help="also time the model's 4-D ops (convolutions, norms, poolings, elementwise ops on images) "
                       "with channels-last (NHWC) inputs and weights, forward and backward, as `train "
                       "--channels-last` runs them; `plan --channels-last` prices from these records")
    @click.option("--precision", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
                  help="bf16: also time every op of the model as a bf16 autocast step runs it (`train --precision "
                       "bf16`: forward under autocast, backward outside); `plan --dtype bf16` prices from these")
    @click.option("--json", "json_", is_flag=True, help="machine-readable output")
    def profile_cmd(  # noqa: PLR0913 - a click command: one parameter per flag
            out, ranks, model, batch, input_shape, splits, sizes, repeats, warmup, no_merge, remeasure_overhead,
            channels_last, precision, json_):
        """Measure op times, matmul peak and gloo collectives (per kind and group size) on this machine."""
        from hybridpar.graph.models import parse_shape
        from hybridpar.profile.run import (
            ProfileOptions,
            calibration_path,
            op_specs,
            overhead_to_keep,
            run_profile,
            sizes_default,
        )

        opts = ProfileOptions(
            ranks=parse_int_list(ranks, "--ranks"),
            sizes=parse_int_list(sizes, "--sizes", binary_suffixes=True) if sizes else tuple(sizes_default()),
            model=model or None, batch=batch, input_shape=parse_shape(input_shape),
            splits=parse_int_list(splits, "--splits"), warmup=warmup, repeats=repeats, merge=not no_merge,
            remeasure_overhead=remeasure_overhead, channels_last=channels_last, precision=precision)
        opts.validate()
        specs = op_specs(opts)  # bad --model fails here, before any progress output
        kept = overhead_to_keep(opts, calibration_path(out)) is not None
        if json_:
            cal, path = run_profile(opts, out, specs=specs)
            print_json({"path": str(path), **cal.model_dump(mode="json")})
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err_console, transient=True) as bar:
            task = bar.add_task("profiling", total=None)

            def step(desc: str, total: int) -> None:
                if bar.tasks[0].total is None:
                    bar.update(task, total=total)
                else:
                    bar.advance(task)
                bar.update(task, description=desc)

            cal, path = run_profile(opts, out, progress=step, specs=specs)
        _print(cal, path, kept)


def _print(cal, path, overhead_kept: bool = False) -> None:
    console.print(f"calibration written to {path}")
    bf16 = f", bf16 {cal.peak_flops_bf16 / 1e9:.3g}" if cal.peak_flops_bf16 else ""
    console.print(f"matmul (1 thread): fp32 {cal.peak_flops_fp32 / 1e9:.3g}{bf16} GFLOP/s; copy bandwidth "
                  f"{cal.mem_bw_Bps / 1e9:.3g} GB/s; {cal.cpu_count} core(s)")
    o = cal.runtime_overhead
    if o is not None:
        node = (o.sample_node_fwd_s + o.sample_node_bwd_s) * 1e6
        dt_node = (o.dtensor_node_fwd_s + o.dtensor_node_bwd_s) * 1e6
        layer = (o.layer_fwd_s + o.layer_bwd_s) * 1e3
        console.print(f"runtime's own work per step (fwd + bwd): {node:.0f} us per node sample-only, {dt_node:.0f} us "
                      f"per node under a channel/filter split, {layer:.2f} ms per split conv/linear"
                      + (f", {o.redistribute_s * 1e6:.0f} us per DTensor redistribution" if o.redistribute_s else "")
                      + (" (kept from the file; --remeasure-overhead to measure it again)" if overhead_kept else ""))
    rows = [[p, f.alpha_s * 1e6, 1e-6 / f.beta_s_per_byte if f.beta_s_per_byte else float("inf"),
             f.max_rel_residual, max(m.rel_spread for m in f.times)] for p, f in sorted(cal.gloo.items())]
    console.print(table("gloo allreduce fit: T = 2(p-1) alpha + 2(p-1)/p n beta",
                        ["ranks", "alpha us", "1/beta MB/s", "worst fit error", "worst spread (p90-p10)/med"],
                        rows))
    if cal.collectives:
        fits = sorted(cal.collectives, key=lambda f: (f.world_size, f.group_size, f.kind))
        c_rows = [[f.kind, f.world_size, f.group_size, f.intercept_s * 1e3, f.predict_s(1 << 20) * 1e3,
                   f.max_rel_residual] for f in fits]
        console.print(table("gloo collectives in a step: T(n) = a + b n (what the localhost cost model uses)",
                            ["kind", "ranks", "group", "a ms", "T(1 MiB) ms", "worst fit error"], c_rows,
                            justify_right=lambda c: c != "kind"))
    here = os.getcwd() + os.sep  # the specs are filed with their paths resolved (model_key): shown relative
    if cal.layout_steps:  # the plan prices these layouts' compute with them (search.layers.measured)
        st_rows = [[st.model.replace(here, ""), st.batch, st.layout, st.step_s * 1e3, st.collectives_s * 1e3,
                    st.redistributions_s * 1e3, st.rest_s * 1e3] for st in cal.layout_steps]
        console.print(table("models' steps on a fake world (rank 0's CPU, ms; plans price these layouts with `rest`)",
                            ["model", "batch", "layout", "step", "collectives", "redistributions", "rest"], st_rows,
                            justify_right=lambda c: c not in ("model", "layout")))
    for what, why in cal.layout_steps_skipped.items():  # the dry run refuses these: no plan uses them
        console.print(f"not timed on a fake world: {what.replace(here, '')}: the runtime cannot run it ({why})")
    if cal.untimed:  # priced by the roofline; plans on this file say so in their notes
        console.print(f"{len(cal.untimed)} op shape(s) could not be timed (the file's `untimed` lists why; the "
                      f"roofline prices them): {', '.join(sorted({k.split('|', 1)[0] for k in cal.untimed}))}")
    if cal.ops:
        ops_rows = [[r.op, r.key.split("|", 1)[1], r.fwd.median_s * 1e3, r.bwd_data.median_s * 1e3,
                     r.bwd_weight.median_s * 1e3 if r.bwd_weight else 0.0, r.fwd.rel_spread]
                    for r in list(cal.ops.values())[:40]]
        console.print(table(f"op times, ms ({len(cal.ops)} shapes)",
                            ["op", "shapes", "fwd", "bwd data", "bwd weight", "fwd spread"], ops_rows,
                            justify_right=lambda c: c not in ("op", "shapes")))
