"""The checks a run's options share: counts, output paths a run will write, the profiler's window.

Each raises UserError with `param` naming the option (the command line shows it as its flag).
"""

from __future__ import annotations

import os
from pathlib import Path

from hybridpar.errors import UserError


def check_counts(**counts: int | None) -> None:
    for name, v in counts.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise UserError(f"{name} must be an integer, got {v!r}", param=name)
        if v is not None and v < 1:
            raise UserError(f"{name} must be >= 1, got {v}", param=name)


def parse_profile_steps(spec: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """`A:B` (steps A..B-1, 0 <= A < B) as (A, B); UserError naming profile_steps otherwise."""
    if spec is None:
        return None
    parts = list(spec) if isinstance(spec, (tuple, list)) else str(spec).split(":")
    try:
        if len(parts) != 2 or any(isinstance(p, (bool, float)) for p in parts):
            raise ValueError
        a, b = (int(str(p).strip()) for p in parts)
    except ValueError:
        raise UserError(f"profile_steps must be A:B with integers 0 <= A < B, got {spec!r}",
                        param="profile_steps") from None
    if a < 0 or b <= a:
        raise UserError(f"profile_steps must be A:B with integers 0 <= A < B, got {spec!r}", param="profile_steps")
    return a, b


def check_output_dir(path: str | None, param: str) -> None:
    """A directory this run will write into: not an existing file, and it exists or can be made."""
    if path is None:
        return
    p = Path(path)
    if str(path) == "" or (p.exists() and not p.is_dir()):
        raise UserError(f"{param} {path}: is not a directory", param=param)
    existing = next((q for q in (p, *p.parents) if q.exists()), Path("."))
    if not existing.is_dir():
        raise UserError(f"{param} {path}: {existing} is not a directory", param=param)
    from hybridpar.train.checkpoint import can_create_in

    if not can_create_in(existing):
        raise UserError(f"{param} {path}: not writable", param=param)


def check_output_path(path: str | None, param: str) -> None:
    """A file this run will write: not a directory, and its folder exists (or can be made) and is
    writable. Checked now, not after the training it would hold."""
    if path is None:
        return
    p = Path(path)
    if str(path) == "" or p.is_dir() or str(path).endswith(os.sep):
        raise UserError(f"{param} {path}: is a directory, expected a file path", param=param)
    from hybridpar.files import output_target_problem

    if why := output_target_problem(p):  # a symlink, device, FIFO: never replaced by a regular file
        raise UserError(f"{param} {path}: {why}", param=param)
    parent = p.parent
    existing = next((q for q in (parent, *parent.parents) if q.exists()), Path("."))
    if not existing.is_dir():
        raise UserError(f"{param} {path}: {existing} is not a directory", param=param)
    from hybridpar.train.checkpoint import can_create_in

    if not can_create_in(existing):
        raise UserError(f"{param} {path}: not writable", param=param)
