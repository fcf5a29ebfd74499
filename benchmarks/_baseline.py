"""A previous commit checked out beside this one, for side-by-side benchmarks (new vs old in one run)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worktree_src(rev: str) -> Path:
    """The `src` folder of a detached git worktree of `rev` (created once under $TMPDIR, reused);
    put it first on PYTHONPATH to run that commit's hybridpar."""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"hybridpar-bench-{rev}"
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(path), rev],
                       check=True, capture_output=True)
    return path / "src"
