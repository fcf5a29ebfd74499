"""Writing a file atomically: a reader (or a crash) sees the old file or the new one, never half of one.

The one helper every writer uses (plans, calibration, reports, caches, the profiler's worker, the
training log). It writes a temporary file beside the target, flushes it to disk and renames it over
the target. The temporary file is created with mode 0666 filtered by the umask, as `open()` would
(typically 0644), not `tempfile.mkstemp`'s 0600: plans and reports are meant to be shared.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | os.PathLike, data: str | bytes | Callable[[BinaryIO], object], *,
                 encoding: str = "utf-8") -> Path:
    """Write `data` (text, bytes, or a function that writes to the open binary file) to `path`.

    Missing parent folders are created. OSError propagates (callers decide whether a failed write is
    the user's error or only a missed cache); the temporary file never outlives a failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode(encoding) if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _create_beside(path: Path) -> tuple[int, Path]:
    """A new, exclusively created file next to `path`; the kernel applies the umask to 0o666."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
