"""Reading a user's JSON file: every way it can be bad is one UserError line naming the file."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybridpar.errors import UserError


def read_json(path: str | os.PathLike, what: str) -> object:
    """Parsed JSON of `path`; `what` names the file in errors (e.g. "plan", "measured run")."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise UserError(f"cannot read {what} {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise UserError(f"{what} {path} is not UTF-8 text (byte {err.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(f"{what} {path} is not valid JSON: line {err.lineno}: {err.msg}") from None
    except RecursionError:
        raise UserError(f"{what} {path}: JSON nested too deeply") from None
