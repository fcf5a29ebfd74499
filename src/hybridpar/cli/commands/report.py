"""`hybridpar report`: one self-contained HTML page for a plan, optionally beside a measured run."""

from __future__ import annotations

from pathlib import Path

import click

from hybridpar.cli.output import console, err_console, human_bytes, print_json
from hybridpar.errors import UserError


def register(app: click.Group) -> None:
    @app.command("report")
    @click.option("--plan", "plan_path", required=True, type=click.Path(dir_okay=False),
                  help="plan.json written by `hybridpar plan` / `place` (or by hand)")
    @click.option("--measured", "measured_path", type=click.Path(dir_okay=False), default=None,
                  help="JSON printed by `hybridpar train --json`, to compare with the prediction")
    @click.option("--projection", "projection_path", type=click.Path(dir_okay=False), default=None,
                  help="JSON printed by `hybridpar project --json`, for the scaling plot")
    @click.option("--out", "out_path", type=click.Path(dir_okay=False), default="report.html",
                  show_default=True, help="HTML file to write")
    @click.option("--json", "json_", is_flag=True, help="machine-readable output")
    def report_cmd(plan_path: str, measured_path: str | None, projection_path: str | None, out_path: str,
                   json_: bool) -> None:
        """Write an HTML report: layout per layer, predicted time/memory, projection, Gantt, measured."""
        from rich.progress import Progress

        from hybridpar.files import atomic_write
        from hybridpar.plans import load_plan
        from hybridpar.report import build_report, load_measured
        from hybridpar.report.extras import load_projection

        # Read and validate every input before writing anything.
        plan = load_plan(plan_path)
        measured = load_measured(measured_path) if measured_path else None
        projection = load_projection(projection_path) if projection_path else None
        if json_:
            report = build_report(plan, measured, projection)
        else:
            with Progress(console=err_console, transient=True) as bar:
                task = bar.add_task("report", total=6)
                report = build_report(plan, measured, projection, on_section=lambda t: bar.update(
                    task, advance=1, description=f"report: {t}"))
        try:
            atomic_write(out_path, report.html)
        except OSError as err:
            raise UserError(f"cannot write {out_path}: {err.strerror}") from None
        size = Path(out_path).stat().st_size
        if json_:
            print_json({"out": str(out_path), "bytes": size, "sections": list(report.sections),
                        "notes": list(report.notes)})
            return
        console.print(f"wrote {out_path} ({human_bytes(size)}; sections: {', '.join(report.sections)})")
        for n in report.notes:
            console.print(f"  note: {n}", style="dim")
