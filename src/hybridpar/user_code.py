"""Running the user's own Python: a `file.py:factory` spec imported and called, every failure one line.

A user's file can raise anything on import, call sys.exit, or name a function it does not have; each is
a UserError (exit 2, one line) that names the file, never a traceback or the file's own exit status.
Used for model factories (hybridpar.graph.models) and data set factories (hybridpar.train.data.files)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from hybridpar.errors import UserError


def call_factory(spec: str, default_fn: str, where: str, *, sep: str = ":"):
    """Import `path.py` of `spec` ("path.py:fn", or "path.py" for `default_fn`) and return fn()'s result.
    `where` starts every message (e.g. "model file", "--data x.py:ds")."""
    path_s, _, fn_name = spec.rpartition(":") if sep in spec else (spec, "", default_fn)
    fn_name = fn_name or default_fn
    path = Path(path_s)
    if not path.is_file():
        raise UserError(f"{where} {path_s!r} not found")
    mod_name = f"_hybridpar_user_{abs(hash(str(path.resolve())))}"
    try:
        mspec = importlib.util.spec_from_file_location(mod_name, path)
        if mspec is None or mspec.loader is None:
            raise UserError(f"{where}: cannot import {path_s!r} as Python")
        module = importlib.util.module_from_spec(mspec)
        sys.modules[mod_name] = module
        mspec.loader.exec_module(module)
    except UserError:
        raise
    except SystemExit as err:  # a file that exits on import must not end a command with its status
        raise UserError(f"{where}: cannot import {path_s!r}: it called sys.exit({err.code})") from None
    except Exception as err:  # noqa: BLE001 -- a user's file can raise anything on import
        raise UserError(f"{where}: cannot import {path_s!r}: {type(err).__name__}: {err}") from None
    factory = getattr(module, fn_name, None)
    if not callable(factory):
        raise UserError(f"{where}: {path_s!r} has no callable {fn_name!r}")
    try:
        return factory()
    except SystemExit as err:  # ... nor a factory that exits: an error, not the factory's exit status
        raise UserError(f"{where}: factory {spec!r} called sys.exit({err.code})") from None
    except Exception as err:  # noqa: BLE001 -- so can their factory
        raise UserError(f"{where}: factory {spec!r} raised {type(err).__name__}: {err}") from None
