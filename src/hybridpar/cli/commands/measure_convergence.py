"""`hybridpar measure-convergence`: epochs-to-target vs batch size on a real small task, fitted."""

from __future__ import annotations

import json

import click

from hybridpar.cli.output import console, err_console, print_json, table
from hybridpar.cli.parsing import parse_int_list
from hybridpar.errors import UserError
from hybridpar.files import atomic_write


def register(app: click.Group) -> None:
    @app.command("measure-convergence")
    @click.option("--model", default="small_cnn", show_default=True, help="zoo model that takes 1x8x8 digits")
    @click.option("--data", default="digits", show_default=True, help="data set (bundled: digits)")
    @click.option("--target", type=float, default=0.95, show_default=True, help="held-out accuracy to reach")
    @click.option("--batches", default="16,32,64,128,256,512,1024", show_default=True,
                  help="comma-separated global batch sizes")
    @click.option("--seeds", type=int, default=3, show_default=True, help="runs per batch size")
    @click.option("--max-epochs", type=float, default=100.0, show_default=True,
                  help="give up on a run after this many epochs")
    @click.option("--base-lr", type=float, default=0.05, show_default=True, help="lr at --base-batch")
    @click.option("--base-batch", type=int, default=32, show_default=True, help="batch of --base-lr")
    @click.option("--max-lr", type=float, default=0.8, show_default=True, help="cap of the linearly scaled lr")
    @click.option("--warmup-epochs", type=float, default=1.0, show_default=True, help="linear lr warm-up")
    @click.option("--out", type=click.Path(dir_okay=False), default=None,
                  help="write the fitted curve (JSON) for `hybridpar project --convergence`")
    @click.option("--json", "json_", is_flag=True, help="machine-readable output")
    def measure_cmd(  # noqa: PLR0913 - a click command: one parameter per flag
            model: str, data: str, target: float, batches: str, seeds: int, max_epochs: float,
            base_lr: float, base_batch: int, max_lr: float, warmup_epochs: float, out: str | None,
            json_: bool) -> None:
        """Train MODEL on DATA to TARGET accuracy at each batch size; fit E(B) = E_min (1 + B/B_noise)."""
        from hybridpar.convergence.measure import LRRule, check_request, measure, measurement_json

        bs = parse_int_list(batches, "--batches")
        if min(base_lr, max_lr) <= 0 or base_batch < 1 or warmup_epochs < 0 or max_epochs <= 0:
            raise UserError("--base-lr, --max-lr, --max-epochs must be > 0, --base-batch >= 1, --warmup-epochs >= 0")
        check_request(model, data, target, bs, seeds)
        rule = LRRule(base_lr=base_lr, base_batch=base_batch, max_lr=max_lr, warmup_epochs=warmup_epochs)
        if json_:
            m = measure(model, data, target, bs, seeds, rule=rule, max_epochs=max_epochs)
        else:
            from rich.progress import Progress

            with Progress(console=err_console, transient=True) as prog:
                task = prog.add_task("training", total=len(bs) * seeds)
                m = measure(model, data, target, bs, seeds, rule=rule, max_epochs=max_epochs,
                            on_run=lambda r: prog.update(task, advance=1, description=f"batch {r.batch} seed {r.seed}"))
        result = measurement_json(m)
        if out:
            try:
                atomic_write(out, json.dumps(result, indent=2))
            except OSError as err:
                raise UserError(f"cannot write {out!r}: {err.strerror}") from None
        if json_:
            print_json(result)
            return
        rows = [[r["batch"], r["lr_peak"], r["epochs_mean"] if r["epochs_mean"] is not None else "not reached",
                 r["epochs_sd"], f"{r['reached']}/{r['seeds']}",
                 m.curve.epochs(r["batch"]) if m.curve else "-"] for r in result["per_batch"]]
        console.print(table(f"{model} on {data}: epochs to held-out accuracy {target}",
                            ["batch", "peak lr", "epochs", "sd", "reached", "fit"], rows))
        if m.curve:
            c = m.curve
            console.print(f"fit: E(B) = {c.e_min:.3g} (+-{c.e_min_sd:.2g}) x "
                          f"(1 + B / {c.b_noise:.4g} (+-{c.b_noise_sd:.2g}))")
            for note in c.notes():
                console.print(f"  note: {note}")
        else:
            console.print("no fit: fewer than two batch sizes reached the target")
        if out:
            console.print(f"curve written to {out}")
