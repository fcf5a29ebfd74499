"""Reading a user's input file: every way it can be bad is one UserError line naming the file.

`read_input` is the one bounded read every input file goes through; `read_json` parses on top of it."""

from __future__ import annotations

import json
import os
import stat

from hybridpar.errors import UserError


def read_json(path: str | os.PathLike, what: str) -> object:
    """Parsed JSON of `path`; `what` names the file in errors (e.g. "plan", "measured run")."""
    text = read_input_text(path, what)  # a regular file within the size limit, never a FIFO
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(f"{what} {path} is not valid JSON: line {err.lineno}: {err.msg}") from None
    except RecursionError:
        raise UserError(f"{what} {path}: JSON nested too deeply") from None


# -- reading an input file -------------------------------------------------------------------------
# Every file a user names as input (a plan, a --config, a run for `report`, a calibration, a cluster
# file) is read through read_input: a FIFO would block forever and /dev/zero reads until MemoryError,
# so only regular files are read, and only up to a limit (a 5000-layer plan is ~2 MB).
MAX_INPUT_ENV = "HYBRIDPAR_MAX_INPUT_BYTES"
MAX_INPUT_DEFAULT = 64 << 20


def max_input_bytes() -> int:
    """The input-file size limit: $HYBRIDPAR_MAX_INPUT_BYTES, else 64 MiB."""
    raw = os.environ.get(MAX_INPUT_ENV, "").strip()
    if not raw:
        return MAX_INPUT_DEFAULT
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise UserError(f"{MAX_INPUT_ENV}={raw!r}: expected a whole number of bytes >= 1")
    return value


def read_input(path: str | os.PathLike, what: str) -> bytes:
    """The bytes of the regular file `path`; UserError (one line, `what` names the file) if it is
    missing, not a regular file, or larger than max_input_bytes(). Never blocks on a FIFO."""
    limit = max_input_bytes()
    try:  # O_NONBLOCK: opening a FIFO with no writer would otherwise wait for one
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise UserError(f"cannot read {what} {path}: {err.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else (
                "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
            raise UserError(f"{what} {path} is {kind}; only regular files are read")
        if st.st_size > limit:
            raise UserError(f"{what} {path} is {st.st_size} bytes, over the {limit}-byte limit ({MAX_INPUT_ENV})")
        try:
            data = f.read(limit + 1)  # a file growing while read is still cut at the limit
        except OSError as err:
            raise UserError(f"cannot read {what} {path}: {err.strerror}") from None
    if len(data) > limit:
        raise UserError(f"{what} {path} is over the {limit}-byte limit ({MAX_INPUT_ENV})")
    return data


def read_input_text(path: str | os.PathLike, what: str) -> str:
    """read_input decoded as UTF-8; UserError naming the first bad byte otherwise."""
    data = read_input(path, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{what} {path} is not UTF-8 text (byte {err.start})") from None
