"""Parsing option values the same way in every command."""

from __future__ import annotations

from hybridpar.errors import UserError


def parse_int_list(text: str, option: str, *, binary_suffixes: bool = False) -> tuple[int, ...]:
    """'16,64,256' -> (16, 64, 256): comma-separated positive integers (spaces and empty items ignored).

    With `binary_suffixes`, a K or M suffix multiplies by 1024 or 2**20 ('64K,1M'). Anything else is
    one UserError line naming `option`."""
    example = "64K,1M" if binary_suffixes else "16,64,256"
    bad = UserError(f"{option} {text!r}: expected comma-separated positive integers, e.g. {example}")
    out = []
    for tok in str(text).split(","):
        tok = tok.strip().upper()
        if not tok:
            continue
        mult = 1
        if binary_suffixes and tok.endswith(("K", "M")):
            mult = 1024 if tok[-1] == "K" else 1 << 20
            tok = tok[:-1]
        try:
            value = int(tok) * mult
        except ValueError:
            raise bad from None
        if value < 1:
            raise bad
        out.append(value)
    if not out:
        raise bad
    return tuple(out)
