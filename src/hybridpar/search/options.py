"""Config objects built from keyword arguments: one rule for the planner's and the placer's."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

C = TypeVar("C")


def with_options(cls: type[C], config: C | None, options: Mapping[str, Any] | None) -> C:
    """`config` (default: `cls()`) with `options` over it; TypeError for a keyword that is not a field,
    as a misspelt keyword argument would raise. A shape option becomes a tuple (the configs are frozen
    and hashed)."""
    base = config if config is not None else cls()
    if not options:
        return base
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r} ({cls.__name__} fields: {', '.join(names)})")
    opts = dict(options)
    if opts.get("input_shape") is not None:
        opts["input_shape"] = tuple(opts["input_shape"])
    return dataclasses.replace(base, **opts)  # type: ignore[type-var]
