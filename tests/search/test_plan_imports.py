"""`hybridpar plan` of a zoo model whose traced graph is cached imports neither torch nor any other
command's module (the planner's speed: torch alone takes longer to import than the whole plan)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hybridpar.search.graph_cache import traced_graph

PROBE = """
import contextlib, io, json, sys
from hybridpar.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = main(["plan", "--model", "small_cnn", "--cluster", "dgx-a100", "--gpus", "8", "--batch", "64", "--json"])
heavy = [m for m in ("torch", "scipy", "sympy") if m in sys.modules]
commands = sorted(m for m in sys.modules if m.startswith("hybridpar.cli.commands."))
print(json.dumps({"rc": rc, "heavy": heavy, "commands": commands, "method": json.loads(out.getvalue())["method"]}))
"""


def test_plan_from_the_graph_cache_imports_no_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDPAR_CACHE", str(tmp_path))
    traced_graph("small_cnn", None)  # fills the cache (this process may import torch)
    env = {**os.environ, "HYBRIDPAR_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0 and got["method"]
    assert got["heavy"] == []
    assert got["commands"] == ["hybridpar.cli.commands.plan"]
