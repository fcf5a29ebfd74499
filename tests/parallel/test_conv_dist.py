"""Distributed convolution / linear vs the serial computation on real gloo ranks.

Hypothesis draws a list of cases in the parent; one process group per world size runs them all
(spawning per example would cost seconds each)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from hybridpar.train.launch import spawn

from . import _workers

TOL = 1e-5

STRATEGIES = {
    2: ["sample=2", "channel=2", "filter=2"],
    4: ["channel=4", "filter=4", "sample=2,channel=2", "sample=2,filter=2", "channel=2,filter=2", "sample=4"],
    8: ["channel=8", "sample=2,channel=2,filter=2", "channel=4,filter=2", "channel=2,filter=4"],
}


@st.composite
def conv_case(draw, small: bool = False):
    k = draw(st.sampled_from([1, 3, 7]))
    hw = draw(st.integers(k, k + (3 if small else 6)))
    return {"kind": "conv", "seed": draw(st.integers(0, 10_000)), "k": k, "hw": hw,
            "cin": draw(st.integers(1, 6 if small else 11)), "cout": draw(st.integers(1, 6 if small else 11)),
            "stride": draw(st.sampled_from([1, 2])), "padding": draw(st.integers(0, k // 2 + 1)),
            "dilation": draw(st.sampled_from([1, 1, 2])) if hw >= 2 * k else 1,
            "bias": draw(st.booleans()), "n": 8}


@st.composite
def linear_case(draw):
    return {"kind": "linear", "seed": draw(st.integers(0, 10_000)), "cin": draw(st.integers(1, 20)),
            "cout": draw(st.integers(1, 20)), "bias": draw(st.booleans()), "n": 8}


def _check(results):
    bad = [r for r in results if max(r["y"], r["dx"], r["dw"]) > TOL]
    assert not bad, bad[:3]


# A real search: hypothesis draws EXAMPLES random cases (not derandomised, every run new ones) in the
# parent, and one process group per world size runs them all; spawning ranks per example would cost
# seconds each, so a failing case is reported as drawn, not shrunk.
EXAMPLES = 50


def _drawn(strategy, n: int) -> list[dict]:
    cases: list[dict] = []

    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.generate])
    @given(case=strategy)
    def collect(case):
        cases.append(case)

    collect()
    return cases


# always included besides the drawn ones: the uneven, stride-2, 1x1 and 7x7 shapes the issue names
FIXED = [
    {"kind": "conv", "seed": 1, "k": 3, "hw": 9, "cin": 5, "cout": 7, "stride": 2, "padding": 1,
     "dilation": 1, "bias": True, "n": 8},
    {"kind": "conv", "seed": 2, "k": 1, "hw": 5, "cin": 3, "cout": 9, "stride": 1, "padding": 0,
     "dilation": 1, "bias": False, "n": 8},
    {"kind": "conv", "seed": 3, "k": 7, "hw": 12, "cin": 6, "cout": 5, "stride": 2, "padding": 3,
     "dilation": 1, "bias": True, "n": 8},
]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_strategies_match_serial(world):
    drawn = _drawn(st.one_of(conv_case(small=True), linear_case()), EXAMPLES)
    assert len(drawn) >= 50, f"only {len(drawn)} examples drawn"  # the issue asks for 50: cut it and this fails
    assert any(c["cin"] % world or c["cout"] % world for c in drawn), "no uneven pieces drawn"
    cases = FIXED + drawn
    results = spawn(_workers.conv_errors, world, cases, STRATEGIES[world])
    bad = [dict(r, case=cases[r["case"]]) for r in results if max(r["y"], r["dx"], r["dw"]) > TOL]
    assert not bad, bad[:3]
    assert len(results) == len(cases) * len(STRATEGIES[world])


@pytest.mark.slow
@settings(max_examples=1, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate])  # shrinking would respawn ranks per step
@given(cases=st.lists(conv_case(small=True), min_size=3, max_size=3))
def test_strategies_match_serial_8_ranks(cases):
    _check(spawn(_workers.conv_errors, 8, cases, STRATEGIES[8]))
