"""The one topological sort."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridpar.toposort import topological_order


@given(st.integers(1, 12).flatmap(lambda n: st.lists(st.lists(st.integers(0, n - 1), max_size=3),
                                                      min_size=n, max_size=n)))
def test_every_vertex_after_its_predecessors(raw):
    preds = [[p for p in ps if p < i] for i, ps in enumerate(raw)]  # edges point forward: acyclic
    order = topological_order(preds)
    pos = {v: k for k, v in enumerate(order)}
    assert sorted(order) == list(range(len(preds)))
    assert all(pos[p] < pos[i] for i, ps in enumerate(preds) for p in ps)


def test_first_ready_first_out_and_by_key():
    # 0 -> 1; 2 free: first ready first out gives 0, 2, 1; by index gives 0, 1, 2
    assert topological_order([[], [0], []]) == [0, 2, 1]
    assert topological_order([[], [0], []], key=lambda i: i) == [0, 1, 2]
    assert topological_order([[], [], []], key=lambda i: -i) == [2, 1, 0]


def test_a_cycle_is_an_error():
    with pytest.raises(ValueError, match="cycle"):
        topological_order([[1], [0], []])
