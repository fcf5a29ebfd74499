"""`hybridpar project`: end-to-end time to target and speedup vs GPU count for DP, hybrid DPxMP and
channel/filter layouts (Pal et al. 2019 projection); `--budget G` adds the joint choice."""

from __future__ import annotations

import click

from hybridpar.cli.options import POSITIVE_FLOAT, cluster_option, gpus_list_option
from hybridpar.cli.output import console, err_console, print_json, table, time_columns
from hybridpar.cli.parsing import parse_int_list
from hybridpar.errors import UserError
from hybridpar.search.placer.unroll import DEFAULT_TIME_CHUNKS

DEFAULT_GPUS = ",".join(str(2**i) for i in range(13))  # 1 .. 4096


def register(app: click.Group) -> None:
    @app.command("project")
    @click.option("--model", required=True, help="zoo model (built-in curves: resnet50, inception_v3, gnmt, biglstm)")
    @cluster_option()
    @gpus_list_option(default=DEFAULT_GPUS, help="device counts to project, comma-separated")
    @click.option("--batch-per-gpu", type=int, default=None,
                  help="samples per data-parallel worker per step: the global batch grows with the workers "
                       "(default: per-model, see docs/convergence.md)")
    @click.option("--convergence", "curve_path", type=click.Path(dir_okay=False), default=None,
                  help="curve JSON from `hybridpar measure-convergence --out` (default: built-in curve)")
    @click.option("--samples-per-epoch", type=int, default=None,
                  help="data-set size, for absolute times with a measured curve")
    @click.option("--mp", "mp_text", default="2,4,8", show_default=True, help="model-parallel degrees to try")
    @click.option("--placer", default="ilp", show_default=True, help="DLPlacer solver: ilp, dp, etf, greedy")
    @click.option("--placer-time-limit", type=POSITIVE_FLOAT, default=3.0, show_default=True,
                  help="seconds per ILP solve")
    @click.option("--time-chunks", "time_chunks", type=int, is_flag=False, flag_value=DEFAULT_TIME_CHUNKS,
                  default=None,
                  help="price DPxMP with each recurrent layer in K time chunks (the time-step wavefront, as "
                       f"`train --time-chunks K` runs it; bare: {DEFAULT_TIME_CHUNKS}); 1 = whole layers  "
                       "[default: the placer's choice per MP degree, as `place` and `train` make it]")
    @click.option("--no-time-chunks", "whole_layers", is_flag=True,
                  help="the same as --time-chunks 1: each recurrent layer whole on one device")
    @click.option("--cf-max-gpus", type=int, default=32, show_default=True,
                  help="plan channel/filter layouts (CNNs) up to this many GPUs")
    @click.option("--dtype", default="fp32", show_default=True, type=click.Choice(["fp32", "fp16", "bf16"]))
    @click.option("--budget", type=int, default=None, help="also choose batch/DP/MP jointly for this many GPUs")
    @click.option("--batch-options", default="16,32,64,128,256", show_default=True,
                  help="per-worker batches the joint choice considers")
    @click.option("--plot", type=click.Path(dir_okay=False), default=None, help="write speedup vs GPUs (PNG)")
    @click.option("--no-cache", is_flag=True, help="recompute placements and plans (no on-disk cache)")
    @click.option("--json", "json_", is_flag=True, help="machine-readable output")
    def project_cmd(  # noqa: PLR0913 - a click command: one parameter per flag
            model: str, cluster: str, gpus: str, batch_per_gpu: int | None, curve_path: str | None,
            samples_per_epoch: int | None, mp_text: str, placer: str, placer_time_limit: float,
            time_chunks: int | None, whole_layers: bool, cf_max_gpus: int, dtype: str, budget: int | None,
            batch_options: str, plot: str | None, no_cache: bool, json_: bool) -> None:
        """Project time to target and speedup over one GPU for every strategy and GPU count."""
        from hybridpar.api import ProjectConfig, project

        if whole_layers:
            if time_chunks not in (None, 1):
                raise UserError(f"--no-time-chunks contradicts --time-chunks {time_chunks}", param="time_chunks")
            time_chunks = 1
        cfg = ProjectConfig(mp_degrees=tuple(parse_int_list(mp_text, "--mp")), batch_per_gpu=batch_per_gpu,
                            curve_path=curve_path, samples_per_epoch=samples_per_epoch, placer=placer,
                            placer_time_limit_s=placer_time_limit, time_chunks=time_chunks, cf_max_gpus=cf_max_gpus,
                            dtype=dtype, budget=budget, batch_options=tuple(parse_int_list(batch_options,
                                                                                             "--batch-options")),
                            use_disk_cache=not no_cache)
        counts = parse_int_list(gpus, "--gpus")
        with _progress(json_ or not err_console.is_terminal) as step:
            result = project(model, cluster, counts, cfg, progress=step)
        proj, sens, joint = result.projection, result.sensitivity, result.joint
        if plot:
            _plot(proj, plot)
        out = result.to_dict()
        if json_:
            print_json(out)
            return
        _print(proj, sens, joint, plot)


class _progress:
    """A rich progress line on stderr (not with --json); yields a callback taking a description."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def __enter__(self):
        if self.quiet:
            return lambda _msg: None
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._p = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                           console=err_console, transient=True)
        self._p.__enter__()
        task = self._p.add_task("projecting")
        return lambda msg: self._p.update(task, description=f"projecting: {msg}")

    def __exit__(self, *exc) -> None:
        if not self.quiet:
            self._p.__exit__(*exc)


def _print(proj, sens: dict, joint, plot: str | None) -> None:
    from hybridpar.search.projection import paper_margin

    timed = bool(proj.curve.samples_per_epoch)
    (time_h, times), = time_columns(["time"], [[proj.best(n).time_s if timed else None for n in proj.gpu_counts]])
    rows = []
    for n, t in zip(proj.gpu_counts, times):
        best = proj.best(n)
        dp, hyb, cf = proj.best(n, "DP"), proj.best(n, "hybrid"), proj.best(n, "CF")
        fsdp = proj.best(n, "FSDP")  # the second baseline: FSDP + full recomputation
        rows.append([n, best.strategy + ("" if best.fits else " (!mem)"), t,
                     f"{dp.speedup:.3g}" + ("" if dp.fits else "*"),
                     f"{fsdp.speedup:.3g}" + ("" if fsdp.fits else "*") if fsdp else "-",
                     f"{hyb.strategy} {hyb.speedup:.3g}" + ("" if hyb.fits else "*") if hyb else "-",
                     f"{cf.strategy} {cf.speedup:.3g}" + ("" if cf.fits else "*") if cf else "-",
                     f"{dp.global_batch:,}", f"{dp.epochs:.3g}"])
    console.print(table(f"{proj.model} on {proj.cluster}: projected speedup over 1 GPU "
                        f"({proj.batch_per_gpu} samples per worker)",
                        ["GPUs", "best", time_h if timed else "time", "DP", "FSDP+recompute", "best hybrid",
                         "channel/filter",
                         "DP batch", "DP epochs"],
                        rows))
    console.print("  * does not fit in device memory (shown as if it did); speedups include epochs to target")
    c = proj.crossover()
    console.print(f"crossover: hybrid overtakes DP-only at {c} GPUs" if c else
                  "crossover: hybrid does not overtake DP-only in this GPU range")
    m1, m2, pm = proj.margin_at_scale(), proj.margin_best_vs_best(), paper_margin(proj.model)
    paper = f"   paper (Pal et al. 2019): {pm:.1%}" if pm is not None else ""
    console.print(f"margin at {proj.gpu_counts[-1]} GPUs: {_pct(m1)}; best hybrid vs best DP over the range: "
                  f"{_pct(m2)}{paper}")
    for label, s in sens.items():
        console.print(f"  with {label} ({s['b_noise']:.4g}): crossover {s['crossover_gpus'] or 'none'}, "
                      f"margin at scale {_pct(s['margin_at_scale'])}, best vs best {_pct(s['margin_best_vs_best'])}")
    for note in [*proj.curve.notes(), *proj.notes]:
        console.print(f"  note: {note}")
    if joint:
        console.print(f"\n[bold]joint choice for {joint.budget} GPUs[/bold]: {joint.explanation}")
    if plot:
        console.print(f"plot written to {plot}")


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def _plot(proj, path: str) -> None:
    import matplotlib

    from hybridpar.files import atomic_write

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hybridpar.search.projection import paper_margin

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for strat in dict.fromkeys(p.strategy for p in proj.points):
        pts = sorted((p for p in proj.points if p.strategy == strat), key=lambda p: p.gpus)
        x = [p.gpus for p in pts]
        line, = ax.plot(x, [p.speedup for p in pts], marker="o", ms=3, label=strat,
                        lw=2.2 if strat == "DP" else 1.4)
        ax.fill_between(x, [p.speedup_lo for p in pts], [p.speedup_hi for p in pts], color=line.get_color(),
                        alpha=0.12, lw=0)
        bad = [p for p in pts if not p.fits]
        if bad:
            ax.plot([p.gpus for p in bad], [p.speedup for p in bad], ls="none", marker="x", color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("speedup over 1 GPU (time to target)")
    pm = paper_margin(proj.model)
    m = proj.margin_best_vs_best()
    title = f"{proj.model} on {proj.cluster}, {proj.batch_per_gpu}/worker"
    if m is not None:
        title += f"\nhybrid vs DP best: {m:+.1%}" + (f" (paper: {pm:+.1%})" if pm is not None else "")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, title="band: epochs +-1 sd; x: over memory", title_fontsize=7)
    fig.tight_layout()
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
    except OSError as err:
        raise UserError(f"cannot write plot {path!r}: {err.strerror}") from None
    finally:
        plt.close(fig)
