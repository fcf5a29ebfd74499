"""Strategy strings: `sample=2,channel=2`, `channel=2,filter=2`, `sample=2,height=2`, `mp=2,sample=2`,
`sample=4,zero=3` ... (`zero` is how the sample dimension holds parameters, not a mesh degree)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridpar.errors import UserError
from hybridpar.plans.schema import LayerLayout

_KEYS = ("sample", "depth", "height", "width", "channel", "filter", "mp", "zero")
_NOT_DEGREES = ("zero",)  # keys that multiply no rank count


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
        if key == "zero" and n not in (2, 3):
            raise UserError(f"strategy {text!r}: zero must be 2 or 3 (parameters sharded over the sample ranks; "
                            f"3 reshards them after forward), got {n}")
        if n < 1:
            raise UserError(f"strategy {text!r}: {key} must be >= 1, got {n}")
        degrees[key] = n
    extra = {k: degrees.pop(k) for k in _NOT_DEGREES if k in degrees}
    mp = degrees.pop("mp", 1)
    if world_size is not None and "sample" not in degrees:
        rest = mp
        for n in degrees.values():
            rest *= n
        if world_size % rest:
            raise UserError(f"strategy {text!r} does not divide {world_size} ranks")
        degrees["sample"] = world_size // rest
    strat = Strategy(LayerLayout(**degrees, **extra), mp)
    why = strat.layout.zero_refusal()
    if why is None and strat.layout.zero and mp > 1:
        why = f"strategy {text!r}: zero={strat.layout.zero} does not run with model parallelism (mp > 1) yet"
    if why is not None:
        raise UserError(why)
    if world_size is not None and strat.world_size != world_size:
        raise UserError(f"strategy {text!r} uses {strat.world_size} ranks, but {world_size} were given")
    return strat
