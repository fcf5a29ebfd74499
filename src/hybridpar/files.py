"""Writing a file atomically: a reader (or a crash) sees the old file or the new one, never half of one.

The one helper every writer uses (plans, calibration, reports, caches, the profiler's worker, the
training log). It writes a temporary file beside the target, flushes it to disk and renames it over
the target. The temporary file is created with mode 0666 filtered by the umask, as `open()` would
(typically 0644), not `tempfile.mkstemp`'s 0600: plans and reports are meant to be shared.

It writes only to a new path or over a regular file: an existing symlink, device node, FIFO, socket
or directory at the path is refused (UserError, one line), never replaced by a regular file
(`/dev/stdout`, `/dev/null` as root, a link someone planted). `output_target_problem` says so
before any work starts (`hybridpar train --save` checks it before a rank starts).
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | os.PathLike, data: str | bytes | Callable[[BinaryIO], object], *,
                 encoding: str = "utf-8") -> Path:
    """Write `data` (text, bytes, or a function that writes to the open binary file) to `path`.

    Missing parent folders are created. OSError propagates (callers decide whether a failed write is
    the user's error or only a missed cache); the temporary file never outlives a failure."""
    path = Path(path)
    if why := output_target_problem(path):
        from hybridpar.errors import UserError

        raise UserError(f"{path}: {why}")
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


def output_target_problem(path: str | os.PathLike) -> str | None:
    """Why `path` must not be written as an output file (it exists and is not a regular file), or
    None (a new path, or a regular file to replace)."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # a new path (a bad parent is the caller's to say)
        return None
    except OSError as err:
        return f"cannot be checked ({err.strerror})"
    if stat.S_ISREG(st.st_mode):
        return None
    kind = ("a symlink" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
            else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
            or stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
    return f"is {kind}; outputs are written only to regular files or new paths"


def _create_beside(path: Path) -> tuple[int, Path]:
    """A new, exclusively created file next to `path`; the kernel applies the umask to 0o666."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue

