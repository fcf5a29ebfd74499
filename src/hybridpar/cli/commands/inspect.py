"""`hybridpar inspect`: per-layer table of a model's graph (shapes, parameters, FLOPs, bytes)."""

from __future__ import annotations

from contextlib import nullcontext

import click
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from hybridpar.cli.output import console, err_console, human_bytes, human_flops, print_json, table
from hybridpar.errors import UserError

_DTYPES = ("fp32", "tf32", "fp16", "bf16")


def register(app: click.Group) -> None:
    @app.command("inspect")
    @click.option("--model", "model", required=True,
                  help="zoo name (see `hybridpar models`) or path/to/file.py:factory")
    @click.option("--batch", type=int, default=None,
                  help="samples in the example batch [default: 1, or the batch a factory returns]")
    @click.option("--input-shape", default=None, help="per-sample input shape, e.g. 3,224,224 (C,H,W)")
    @click.option("--coarsen", type=int, default=None, help="coarsen the graph to at most N nodes first")
    @click.option("--dtype", type=click.Choice(_DTYPES), default="fp32", show_default=True,
                  help="element type for the byte columns")
    @click.option("--json", "json_", is_flag=True, help="machine-readable output")
    def inspect_cmd(model: str, batch: int | None, input_shape: str | None, coarsen: int | None, dtype: str,
                    json_: bool) -> None:
        """Trace MODEL and print every layer: op, module, output shape, parameters, FLOPs and bytes."""
        graph = build_graph(model, batch, input_shape, coarsen, progress=not json_)
        rows = layer_rows(graph, dtype)
        totals = _totals(graph, rows)
        if json_:
            print_json({"model": graph.name, "batch": graph.batch, "dtype": dtype, "nodes": len(graph),
                        "tracer": dict(graph.meta).get("tracer"), "totals": totals, "layers": rows})
            return
        _print_table(graph, rows, totals, dtype)


def build_graph(model: str, batch: int | None, input_shape: str | None, coarsen: int | None, *, progress: bool):
    """Load, trace and optionally coarsen `model` (zoo models on the meta device: no weights allocated)."""
    from hybridpar.graph.models import load_model, parse_shape

    if coarsen is not None and coarsen < 1:
        raise UserError(f"--coarsen must be >= 1, got {coarsen}")
    shape = parse_shape(input_shape)
    with _progress(progress) as bar:
        task = bar.add_task("building model", total=None) if bar else None
        loaded = load_model(model, batch=batch, input_shape=shape, device="meta")
        _step(bar, task, "tracing")
        from hybridpar.graph.tracing import trace

        graph = trace(loaded.module, loaded.example_inputs, name=loaded.name)
        if coarsen is not None:
            _step(bar, task, "coarsening")
            from hybridpar.graph.coarsen import coarsen_to

            graph = coarsen_to(graph, coarsen)
    return graph


def _progress(enabled: bool):
    # Only on an interactive stderr: a piped one would get stray blank lines around errors.
    if not enabled or not err_console.is_terminal:
        return nullcontext(None)
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                    console=err_console, transient=True)


def _step(bar, task, text: str) -> None:
    if bar is not None:
        bar.update(task, description=text)


def layer_rows(graph, dtype: str) -> list[dict]:
    rows = []
    for n in graph.nodes:
        row = {"name": n.name, "op": n.op, "module": n.module, "out_shape": list(n.out_shape), "params": n.params,
               "fwd_flops": n.fwd_flops, "bwd_flops": n.bwd_flops, "bwd_data_flops": n.bwd_data_flops,
               "bwd_weight_flops": n.bwd_weight_flops, "activation_bytes": n.out_bytes(dtype),
               "param_bytes": n.param_bytes(dtype), "inputs": list(n.inputs)}
        members = n.attr("members")
        if members is not None:  # a coarse node: say what it groups
            row.update(scope=n.attr("scope"), members=list(members), modules=list(n.attr("modules")))
        rows.append(row)
    return rows


def _where(row: dict) -> str:
    """Module column: the module, or for a coarse node of several ops its common scope and size."""
    members = row.get("members") or ()
    if len(members) > 1:
        tops = list(dict.fromkeys(m.split(".")[0] for m in row.get("modules") or ()))
        span = row.get("scope") or (f"{tops[0]}..{tops[-1]}" if len(tops) > 1 else "".join(tops) or "-")
        return f"{span} [{len(members)} ops]"
    return row["module"] or "-"


def _totals(graph, rows: list[dict]) -> dict:
    return {"params": graph.params, "fwd_flops": graph.fwd_flops, "bwd_flops": graph.bwd_flops,
            "activation_bytes": sum(r["activation_bytes"] for r in rows if r["op"] != "input"),
            "param_bytes": sum(r["param_bytes"] for r in rows)}


def _print_table(graph, rows: list[dict], totals: dict, dtype: str) -> None:
    cols = ["name", "op", "module", "output shape", "params", "fwd GFLOPs", "bwd GFLOPs",
            f"act bytes ({dtype})", "param bytes"]
    body = [[r["name"], r["op"], _where(r), "x".join(map(str, r["out_shape"])), r["params"],
             r["fwd_flops"] / 1e9, r["bwd_flops"] / 1e9, human_bytes(r["activation_bytes"]),
             human_bytes(r["param_bytes"])] for r in rows]
    body.append(["TOTAL", "", "", "", totals["params"], totals["fwd_flops"] / 1e9, totals["bwd_flops"] / 1e9,
                 human_bytes(totals["activation_bytes"]), human_bytes(totals["param_bytes"])])
    title = f"{graph.name}: {len(graph)} nodes, batch {graph.batch}"
    console.print(table(title, cols, body,
                        justify_right=lambda c: c not in ("name", "op", "module", "output shape")))
    console.print(f"forward {human_flops(totals['fwd_flops'])}FLOP, backward {human_flops(totals['bwd_flops'])}"
                  f"FLOP per step; {totals['params']:,} parameters "
                  f"(traced with {dict(graph.meta).get('tracer')})")
