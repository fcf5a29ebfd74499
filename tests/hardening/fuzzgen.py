"""Hypothesis strategies for malformed inputs: JSON/YAML documents mutated from valid ones, raw bytes,
and strategy strings. Shared by the fuzz tests."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

from hypothesis import strategies as st

_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["", "sample=2", "<script>", "NaN", "inf", "../../etc", "\x00", "é"]),
)
junk = st.recursive(_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                    max_leaves=6)


def _paths(obj: Any, prefix: tuple = ()) -> Iterator[tuple]:
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _parent(obj: Any, path: tuple) -> Any:
    for p in path[:-1]:
        obj = obj[p]
    return obj


@st.composite
def mutated(draw: st.DrawFn, bases: list[Any]) -> Any:
    """A valid document with 1-3 edits: a value replaced by junk or a numeric tweak, a key dropped,
    an unknown key added, or the whole document replaced."""
    doc = copy.deepcopy(draw(st.sampled_from(bases)))
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(doc))
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["junk", "tweak", "tweak", "drop", "add"]))
        if not path:
            if op == "junk":
                doc = draw(junk)
            continue
        parent, key = _parent(doc, path), path[-1]
        old = parent[key]
        if op == "junk":
            parent[key] = draw(junk)
        elif op == "tweak" and isinstance(old, (int, float)) and not isinstance(old, bool):
            parent[key] = draw(st.sampled_from([0, -1, -old, old + 1, old * 3, old / 2, 2**64, float("inf"),
                                                float("nan"), str(old), [old], None]))
        elif op == "tweak" and isinstance(old, str):
            parent[key] = draw(st.sampled_from(["", old + "x", old.upper(), " " + old, 1, None]))
        elif op == "drop":
            del parent[key]
        elif op == "add" and isinstance(old, dict):
            old[draw(st.text(min_size=1, max_size=8))] = draw(junk)
    return doc


@st.composite
def file_text(draw: st.DrawFn, bases: list[Any], dump=json.dumps) -> bytes:
    """File bytes: a mutated document, sometimes truncated or with bytes spliced in (bad JSON/UTF-8)."""
    doc = draw(mutated(bases))
    try:
        data = dump(doc).encode()
    except (ValueError, TypeError):  # not representable (e.g. YAML of odd keys): plain JSON then
        data = json.dumps(doc).encode()
    cut = draw(st.sampled_from(["none", "none", "none", "truncate", "splice", "empty"]))
    if cut == "truncate" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif cut == "splice":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=6)) + data[at:]
    elif cut == "empty":
        data = b""
    return data


_keys = st.sampled_from(["sample", "channel", "filter", "mp", "Sample", "chanel", "dp", "", " mp", "x"])
_vals = st.one_of(st.integers(-3, 70).map(str), st.sampled_from(["", "0", "-1", "2.5", "1e3", "two", "٤", " 2 ",
                                                                 "9" * 40, "0x4", "1_0"]))


@st.composite
def strategy_text(draw: st.DrawFn) -> str:
    """Mostly near-miss strategy strings (real keys, bad values/separators), some free text."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.text(alphabet="samplechnifltrm=,0123456789 -_.;:", max_size=30))
    terms = draw(st.lists(st.tuples(_keys, st.sampled_from(["=", "=", "=", ":", "", "=="]), _vals),
                          min_size=1, max_size=4))
    sep = draw(st.sampled_from([",", ",", ", ", ";", " "]))
    return sep.join(f"{k}{s}{v}" for k, s, v in terms)
