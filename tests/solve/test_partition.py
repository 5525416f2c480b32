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


def _reference_solve(pb):
    """The DP over every piece boundary, as it was before it ran over the allowed cuts only: the reference that
    the faster :func:`solve` must match exactly (bounds, ties and all)."""
    from planner.solve.partition import INF, _matrix, _mem_block, _result

    n, S = pb.n, pb.stages
    if S < 1 or S > n:
        return None
    compute = [_matrix(c) for c in pb.compute]
    static, act = _matrix(pb.static_mem), _matrix(pb.act_mem)
    wgrad = None if pb.wgrad_mem is None else _matrix(pb.wgrad_mem)
    idx = np.arange(n + 1)
    upper = idx[:, None] < idx[None, :]
    allowed = np.asarray(pb.allowed, dtype=bool).copy()
    allowed[0] = allowed[n] = True
    f = np.full(n + 1, INF)
    f[0] = 0.0
    choice = np.zeros((S, n + 1), dtype=np.int64)
    for j in range(S):
        a0, a1 = j, n - S + j + 1
        b0, b1 = j + 1, n - S + j + 2
        rows, cols = slice(a0, a1), slice(b0, b1)
        t = compute[pb.stage_device[j]][rows, cols] + np.asarray(pb.comm_in[j])[rows, None] + np.asarray(pb.comm_out[j])[None, cols]
        ok = upper[rows, cols] & (_mem_block(pb, j, static[rows, cols], act[rows, cols], None if wgrad is None else wgrad[rows, cols]) <= pb.capacity[j])
        ok &= allowed[rows, None]
        ok &= allowed[None, cols] if j < S - 1 else (idx[cols] == n)[None, :]
        cand = np.where(ok, np.maximum(f[rows, None], t), INF)
        best = np.argmin(cand, axis=0)
        f = np.full(n + 1, INF)
        f[cols] = cand[best, np.arange(b1 - b0)]
        choice[j, cols] = best + a0
    if not np.isfinite(f[n]):
        return None
    bounds = [n]
    for j in range(S - 1, -1, -1):
        bounds.append(int(choice[j][bounds[-1]]))
    bounds.reverse()
    return _result(pb, tuple(bounds))


@st.composite
def tied_problems(draw):
    """Instances with whole-number times and bytes (many ties between splits), sparse allowed cuts, matrix or prefix
    inputs, and per-stage count points with a W-input term: every input form the search hands to :func:`solve`."""
    n = draw(st.integers(1, 14))
    S = draw(st.integers(1, 6))
    ints = st.integers(0, 4).map(float)
    compute = [np.concatenate([[0.0], np.cumsum(draw(st.lists(ints, min_size=n, max_size=n)))])]
    if draw(st.booleans()):
        compute = [_matrix_of(compute[0])]
    cut = np.array(draw(st.lists(ints, min_size=n + 1, max_size=n + 1)))
    zero = np.zeros(n + 1)
    comm_in = [zero] + [cut] * (S - 1)
    comm_out = [cut] * (S - 1) + [zero]
    state = _matrix_of(np.concatenate([[0.0], np.cumsum(draw(st.lists(ints, min_size=n, max_size=n)))]))
    act = np.concatenate([[0.0], np.cumsum(draw(st.lists(ints, min_size=n, max_size=n)))])
    wgrad = np.concatenate([[0.0], np.cumsum(draw(st.lists(ints, min_size=n, max_size=n)))])
    points = None
    if draw(st.booleans()):
        pair = st.tuples(st.integers(0, 3).map(float), st.integers(0, 2).map(float))
        points = [tuple(draw(st.lists(pair, min_size=1, max_size=3))) for _ in range(S)]
    held = [float(draw(st.integers(1, 4))) for _ in range(S)]
    capacity = [float(draw(st.integers(0, 40))) if draw(st.booleans()) else float("inf") for _ in range(S)]
    inner = draw(st.lists(st.booleans(), min_size=max(n - 1, 0), max_size=max(n - 1, 0)))
    allowed = np.array([True] + inner + [True])[: n + 1]
    return PartitionProblem(compute, [0] * S, comm_in, comm_out, state, act, held, capacity, allowed, wgrad if points else None, points)


def _matrix_of(prefix):
    return prefix[None, :] - prefix[:, None]


@settings(max_examples=600, deadline=None)
@given(tied_problems())
def test_dp_over_allowed_cuts_equals_the_dp_over_every_boundary(pb):
    """The same partition, bit for bit, as the DP over every piece boundary: same bounds (ties broken the same way),
    stage times and memory; None exactly when it is None."""
    assert solve(pb) == _reference_solve(pb)
