"""Strategy strings: `sample=2,channel=2`, `channel=2,filter=2`, `mp=2,sample=2` ..."""

from __future__ import annotations

from dataclasses import dataclass

from hybridpar.errors import UserError
from hybridpar.plans.schema import LayerLayout

_KEYS = ("sample", "channel", "filter", "mp")


@dataclass(frozen=True)
class Strategy:
    layout: LayerLayout
    mp: int = 1

    @property
    def world_size(self) -> int:
        return self.layout.size * self.mp


def parse_strategy(text: str, world_size: int | None = None) -> Strategy:
    """Parse a uniform strategy string. Missing degrees are 1; if world_size is given and only the
    sample degree is missing, it is inferred so the product equals world_size."""
    if not isinstance(text, str) or not text.strip():
        raise UserError("strategy: empty string (expected e.g. 'sample=4' or 'sample=2,channel=2')")
    degrees: dict[str, int] = {}
    for part in text.split(","):
        key, sep, val = part.strip().partition("=")
        key = key.strip().lower()
        if not sep or key not in _KEYS:
            raise UserError(f"strategy {text!r}: bad term {part.strip()!r} (use {', '.join(_KEYS)}=N)")
        if key in degrees:
            raise UserError(f"strategy {text!r}: {key} given twice")
        try:
            n = int(val)
        except ValueError:
            raise UserError(f"strategy {text!r}: {key} must be a positive integer, got {val!r}") from None
        if n < 1:
            raise UserError(f"strategy {text!r}: {key} must be >= 1, got {n}")
        degrees[key] = n
    mp = degrees.pop("mp", 1)
    if world_size is not None and "sample" not in degrees:
        rest = mp * degrees.get("channel", 1) * degrees.get("filter", 1)
        if world_size % rest:
            raise UserError(f"strategy {text!r} does not divide {world_size} ranks")
        degrees["sample"] = world_size // rest
    strat = Strategy(LayerLayout(**degrees), mp)
    if world_size is not None and strat.world_size != world_size:
        raise UserError(f"strategy {text!r} uses {strat.world_size} ranks, but {world_size} were given")
    return strat
