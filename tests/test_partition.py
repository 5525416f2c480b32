"""The DP partition is exact: it equals brute force on random instances, feasible or not."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.solve.partition import PartitionProblem, brute_force, evaluate, lower_bound, solve


@st.composite
def problems(draw):
    n = draw(st.integers(1, 12))
    S = draw(st.integers(1, 4))
    classes = draw(st.integers(1, 2))
    times = [np.array(draw(st.lists(st.floats(0.0, 10.0), min_size=n, max_size=n))) for _ in range(classes)]
    compute = [np.concatenate([[0.0], np.cumsum(t)]) for t in times]
    stage_device = [draw(st.integers(0, classes - 1)) for _ in range(S)]
    cut_bytes = np.array(draw(st.lists(st.floats(0.0, 3.0), min_size=n + 1, max_size=n + 1)))
    comm_in, comm_out = [], []
    for j in range(S):
        cin = cut_bytes.copy() if j > 0 else np.zeros(n + 1)
        cout = cut_bytes.copy() if j < S - 1 else np.zeros(n + 1)
        comm_in.append(cin)
        comm_out.append(cout)
    state = np.concatenate([[0.0], np.cumsum(draw(st.lists(st.floats(0.0, 5.0), min_size=n, max_size=n)))])
    act = np.concatenate([[0.0], np.cumsum(draw(st.lists(st.floats(0.0, 5.0), min_size=n, max_size=n)))])
    held = [float(draw(st.integers(1, 4))) for _ in range(S)]
    capacity = [draw(st.floats(0.0, 60.0)) for _ in range(S)]
    allowed = np.array([True] + draw(st.lists(st.booleans(), min_size=max(n - 1, 0), max_size=max(n - 1, 0))) + [True])[: n + 1]
    return PartitionProblem(compute, stage_device, comm_in, comm_out, state, act, held, capacity, allowed)


@settings(max_examples=300, deadline=None)
@given(problems())
def test_dp_equals_brute_force(pb):
    dp = solve(pb)
    ref = brute_force(pb)
    if ref is None:
        assert dp is None
        return
    assert dp is not None
    assert dp.bottleneck == pytest.approx(ref.bottleneck, rel=1e-12, abs=1e-12)
    part, over = evaluate(pb, dp.bounds)
    assert not over
    assert all(pb.allowed[k] for k in dp.bounds)
    assert all(a < b for a, b in dp.ranges())


def _uniform(times, S, capacity=1e18, held=None, mem=None, allowed=None):
    n = len(times)
    pre = np.concatenate([[0.0], np.cumsum(times)])
    z = np.zeros(n + 1)
    mem = np.concatenate([[0.0], np.cumsum(mem if mem is not None else np.zeros(n))])
    return PartitionProblem(
        [pre],
        [0] * S,
        [z] * S,
        [z] * S,
        mem,
        np.zeros(n + 1),
        held or [1.0] * S,
        [capacity] * S,
        np.array(allowed if allowed is not None else [True] * (n + 1)),
    )


def test_balanced_split_hits_lower_bound():
    pb = _uniform([1.0] * 12, 4)
    part = solve(pb)
    assert part.bounds == (0, 3, 6, 9, 12)
    assert part.bottleneck == lower_bound(12.0, 1.0, 4)


def test_memory_forces_imbalance_and_infeasibility_is_reported():
    # 6 equal pieces, 2 stages; stage memory = pieces held, capacity 4 pieces: (3,3) fits
    pb = _uniform([1.0] * 6, 2, capacity=4.0, mem=[1.0] * 6)
    assert solve(pb).bounds == (0, 3, 6)
    # capacity 2 pieces per stage cannot hold 6 pieces on 2 stages
    assert solve(_uniform([1.0] * 6, 2, capacity=2.0, mem=[1.0] * 6)) is None


def test_disallowed_cuts_are_never_used():
    allowed = [True, False, True, False, True, False, True]
    part = solve(_uniform([1.0, 5.0, 1.0, 5.0, 1.0, 5.0], 3, allowed=allowed))
    assert all(allowed[k] for k in part.bounds)
    assert part.bounds == (0, 2, 4, 6)
