"""`hybridpar models`: the built-in model zoo."""

from __future__ import annotations

import click

from hybridpar.cli.output import console, print_json, table


def register(app: click.Group) -> None:
    @app.command("models")
    @click.option("--json", "json_", is_flag=True, help="machine-readable output")
    def models_cmd(json_: bool) -> None:
        """List the built-in models."""
        from hybridpar.graph.zoo import ZOO

        rows = [{"name": e.name, "kind": e.kind, "input_shape": list(e.input_shape),
                     "published_params": e.published_params, "description": e.description,
                     "reference": e.reference} for e in sorted(ZOO.values(), key=lambda e: e.name)]
        if json_:
            print_json(rows)
            return
        console.print(table("hybridpar model zoo", ["name", "kind", "input", "published params", "description"],
                            [[r["name"], r["kind"], "x".join(map(str, r["input_shape"])),
                              r["published_params"] or "-", r["description"]] for r in rows],
                            justify_right=lambda c: c == "published params"))
