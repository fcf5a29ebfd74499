"""Process trees read from Linux /proc: who a process started, whether it still runs.

One place for it: the launcher kills what user code left running (user_code.py), and the fault tests
and benchmarks kill or count a job's ranks and loader workers. psutil would do it too, but it is not a
dependency and three small readers of /proc do not justify one."""

from __future__ import annotations

import os
from pathlib import Path


def children(pid: int) -> list[int]:
    """The direct children of `pid` (every thread's, as the kernel lists them); [] once it is gone."""
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            kids += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    except OSError:
        pass
    return kids


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, children first."""
    out: list[int] = []
    todo = [pid]
    while todo:
        for c in children(todo.pop()):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    """Runs (or sleeps, or is stopped): exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
