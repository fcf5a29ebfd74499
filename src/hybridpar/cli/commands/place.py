"""`hybridpar place`: DLPlacer device placement of a model over M devices (model parallelism)."""

from __future__ import annotations

import contextlib

import click

from hybridpar.cli.options import batch_option, cluster_option, gpus_option
from hybridpar.cli.output import console, err_console, human_bytes, print_json, table, time_columns
from hybridpar.search.placer.config import OPTIMIZER_ALIASES, RUN_OPTIMIZERS
from hybridpar.search.placer.unroll import WHAT_IF_TIME_CHUNKS

SOLVER_CHOICES = ("ilp", "dp", "etf", "greedy", "single")


@contextlib.contextmanager
def _progress(enabled: bool, what: str):
    """A spinner with elapsed time on stderr (the ILP runs up to --time-limit seconds)."""
    if not enabled:
        yield
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=err_console, transient=True) as prog:
        prog.add_task(what, total=None)
        yield


def register(app: click.Group) -> None:
    @app.command("place")
    @click.option("--model", required=True, help="zoo name or path/to/file.py:factory")
    @cluster_option()
    @gpus_option(aliases=("--devices",), help="devices of the model-parallel group (M)")
    @click.option("--solver", type=click.Choice(SOLVER_CHOICES), default="ilp", show_default=True)
    @click.option("--time-limit", "time_limit", default=30.0, show_default=True, type=float,
                  help="ILP time limit in seconds")
    @batch_option(help="global batch: samples per step over the M devices (one model-parallel group)")
    @click.option("--coarsen", type=int, default=None,
                  help="max nodes of the coarsened graph [64]; recurrent graphs: N/K nodes before K time chunks")
    @click.option("--time-chunks", "time_chunks", type=int, default=None,
                  help="price each recurrent layer as K time chunks (the time-step wavefront, as `train "
                       "--time-chunks K` runs it; the layers of a stacked nn.LSTM placed one by one); "
                       f"0 or 1 = whole layers  [default: the placer's choice, whole or {WHAT_IF_TIME_CHUNKS} "
                       "chunks, the shorter predicted step]")
    @click.option("--micro-batches", "micro_batches", type=click.IntRange(min=1), default=None,
                  help="GPipe micro-batches per step, priced with their bubble (1: no pipelining)  "
                       "[default: the placer's choice, 1 for a model with batch norm]")
    @click.option("--schedule", type=click.Choice(["gpipe", "1f1b"]), default=None,
                  help="micro-batch schedule, priced: gpipe, or 1f1b (a chain of stages, K >= stages; at most S "
                       "micro-batches' activations held)  [default: chosen with the count under the memory limit]")
    @click.option("--input-shape", default=None, help="per-sample input shape for file models, e.g. 3,32,32")
    @click.option("--workers", default=2, show_default=True, type=int, help="CP-SAT search workers")
    @click.option("--gap", type=float, default=None,
                  help="stop the ILP once within this relative gap of its proven bound, e.g. 0.01; "
                       "0 = search to a proof or the time limit  [default: 0.005]")
    @click.option("--optimizer", type=click.Choice(RUN_OPTIMIZERS + OPTIMIZER_ALIASES), default=None,
                  help="what training steps with, as `hybridpar train --optimizer` takes it: its state in each "
                       "device's memory, its update in the step (old names: momentum = sgd with momentum, "
                       "adam)  [default: sgd --momentum 0.9]")
    @click.option("--momentum", type=float, default=None,
                  help="as `train --momentum` (SGD keeps a momentum buffer when > 0)  [default: 0.9 without "
                       "--optimizer, else 0]")
    @click.option("--gantt", type=click.Path(dir_okay=False), default=None, help="write the schedule as PNG")
    @click.option("--out", type=click.Path(dir_okay=False), default=None, help="write the Plan as JSON")
    @click.option("--json", "json_", is_flag=True, help="machine-readable output")
    def place_cmd(  # noqa: PLR0913 - a click command: one parameter per flag
            model: str, cluster: str, gpus: int, solver: str, time_limit: float, batch: int | None,
            coarsen: int | None, time_chunks: int | None, micro_batches: int | None, schedule: str | None,
            input_shape: str | None,
            workers: int,
            gap: float | None, optimizer: str, momentum: float, gantt: str | None, out: str | None,
            json_: bool) -> None:
        """Place a model's graph on --gpus devices (ILP or a baseline) and predict the per-step time."""
        from hybridpar.api import place
        from hybridpar.graph.models import parse_shape
        from hybridpar.search.placer.config import PlacerConfig

        config = PlacerConfig(solver=solver, time_limit_s=time_limit, batch=batch, coarsen=coarsen,
                              input_shape=parse_shape(input_shape), workers=workers, time_chunks=time_chunks, gap=gap,
                              micro_batches=micro_batches, schedule=schedule)
        chosen = {k: v for k, v in (("optimizer", optimizer), ("momentum", momentum)) if v is not None}
        with _progress(not json_ and err_console.is_terminal, f"placing {model} on {gpus} device(s) with {solver}"):
            outcome = place(model, cluster, gpus, config, **chosen)
        if out:
            outcome.plan.save(out)
        if gantt:
            from hybridpar.search.placer.gantt import save_gantt

            save_gantt(outcome.result, gantt, title=None)
        summary = outcome.summary()
        summary.update(placement=outcome.plan.placement, plan=out, gantt=gantt)
        from hybridpar.graph.params import placed_param_listing
        from hybridpar.graph.types import DTYPE_BYTES

        # every parameterised module with its gradient bytes; they sum to grad_bytes, the placer's
        # weight gradients (what data parallelism over copies of this placement allreduces)
        summary["grad_bytes"] = sum(t.grad_bytes for t in outcome.problem.tasks)
        summary["parameters"] = placed_param_listing(outcome.graph, outcome.result.assignment,
                                                     DTYPE_BYTES["fp32"])  # place prices fp32 (its default)
        if json_:
            print_json(summary)
            return
        _print(summary)


def _print(s: dict) -> None:
    gap = "-" if s["gap"] is None else f"{s['gap']:.2%}"
    fits = "" if s["single_device_fits"] else " (does not fit in one device's memory)"
    # Every duration of a step in one unit (the solver's wall time is another quantity, in seconds).
    times = [("step", s["step_time_s"]), ("one-device step", s["single_device_step_s"]),
             ("compute on critical path", s["compute_s"]), ("exposed transfers", s["exposed_comm_s"]),
             ("all transfers", s["comm_s"]), ("mean device idle", s["idle_s"]),
             *((f"baseline {k}", v) for k, v in s["baselines"].items())]
    (head, cells), = time_columns(["per step"], [[v for _, v in times]])
    unit = head.removeprefix("per step ")
    rows = [["solver", f"{s['solver']} ({s['status']}), solved in {s['solve_time_s']:.3g} s"],
            ["graph nodes", f"{s['nodes']} (from {s['fine_nodes']})"],
            ["speedup over one device", f"{s['speedup']:.3f}x"], ["optimality gap", gap],
            ["micro-batches", f"{s.get('micro_batches') or 1} ({s.get('schedule') or 'gpipe'})"]]
    rows += [[f"{name} {unit}", cell + (fits if name == "one-device step" else "")]
             for (name, _), cell in zip(times[:6], cells[:6])]
    rows += [[f"memory device {d} (gpu {g})", f"{human_bytes(m)} of {human_bytes(c)}"]
             for d, (g, m, c) in enumerate(zip(s["device_ids"], s["memory_bytes"], s["memory_capacity_bytes"]))]
    tag = " (UNCALIBRATED ESTIMATE: see the note below)" if s.get("uncalibrated_estimate") else ""
    console.print(table(f"{s['model']} on {s['devices']} x {s['cluster']} (batch {s['batch']}){tag}",
                        ["name", "value"], rows, justify_right=lambda c: c == "value"))
    base = [[k, cell, f"{s['single_device_step_s'] / v:.3f}x"]
            for (k, v), cell in zip(s["baselines"].items(), cells[6:])]
    console.print(table("baselines (same cost model)", ["name", f"step {unit}", "speedup"], base))
    for note in s["notes"]:
        console.print(f"note: {note}")
    for what in ("plan", "gantt"):
        if s[what]:
            console.print(f"{what} written to {s[what]}")
