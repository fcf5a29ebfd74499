"""The library's functions stay small: none in src/ takes more than 10 parameters (click command functions,
one parameter per flag, excepted) or runs over 100 lines. Options travel in config objects instead
(hybridpar.train.config.TrainConfig and its sections, PlannerConfig, PlacerConfig)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_PARAMS = 10
MAX_LINES = 100


def _is_click_command(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated with a click command or option (`@app.command(...)`, `@click.option(...)`, ...)."""
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        name = ast.unparse(target)
        if name.startswith("click.") or name.endswith((".command", ".group", "_option", "_options")):
            return True
    return False


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
    return count - (1 if names and names[0].arg in ("self", "cls") else 0)


def offenders() -> list[str]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            where = f"{path.relative_to(SRC)}:{node.lineno} {node.name}"
            lines = node.end_lineno - node.lineno + 1
            if _params(node) > MAX_PARAMS and not _is_click_command(node):
                out.append(f"{where}: {_params(node)} parameters (at most {MAX_PARAMS}; use a config object)")
            if lines > MAX_LINES:
                out.append(f"{where}: {lines} lines (at most {MAX_LINES}; split it into named steps)")
    return out


def test_no_function_with_too_many_parameters_or_lines():
    assert offenders() == []


def test_the_scan_sees_what_it_should(tmp_path):
    tree = ast.parse("def f(a, b, c, d, e, f, g, h, i, j, k): pass\n"
                     "class C:\n    def m(self, a, b, c, d, e, f, g, h, i, j): pass\n"
                     "@click.option('--x')\ndef cmd(a, b, c, d, e, f, g, h, i, j, k): pass\n")
    fns = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert _params(fns["f"]) == 11 and _params(fns["m"]) == 10
    assert not _is_click_command(fns["f"]) and _is_click_command(fns["cmd"])
