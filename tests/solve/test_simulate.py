"""The event-driven simulator: closed forms in the uniform case, invariants on
random costs, deadlock detection, memory peaks and speed.

Closed forms (uniform stages, no communication unless stated; F, B, W are the
forward, backward-input and backward-weight times of one microbatch on one
stage, B+W the full backward):

- GPipe and 1F1B: step = (m+p-1)(F+B+W), bubble fraction (p-1)/(m+p-1)
  (Narayanan et al. 2021). With a send of c seconds on every hop GPipe adds
  exactly 2(p-1)c.
- Interleaved 1F1B, m a multiple of p: idle / ideal compute = (p-1)/(v m)
  (per-chunk times; Narayanan et al. 2021 section 2.2.2); rank 0 holds
  v p + p - 1 chunk-microbatches, i.e. p (1 + (p-1)/(p v)) stage-microbatches
  (Megatron's memory factor).
- ZB-H1 (m >= p): idle per rank (p-1) max(F, B, F+B-W). When W <= min(F, B) this
  is the paper's (p-1)(F+B-W) (Qi et al. 2023, section 2); with F=B=W it is
  (p-1)/(3m) of the ideal compute. Note: formulas.md's "(p-1)(F+B-2W)" is the
  ZB-H2 figure; its own "(p-1)/(3m) when F=B=W" matches F+B-W.
- ZB-V with F=B=W=f per chunk and m >= 2p-1: step = 6 m f + (p-1) f, which is
  also the lower bound (rank p-1 cannot start before (p-1) f).
- Interleaved zero bubble (v chunks): idle (p-1) max(f, b, f+b-w) per rank.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from planner.solve.schedules import SCHEDULES, Action, Schedule, build_schedule, schedule_constraints
from planner.solve.simulate import SimResult, StageMemory, StageTimes, critical_path, simulate

REL = 1e-12
PM = [(1, 1), (1, 5), (2, 1), (2, 4), (3, 7), (4, 3), (4, 8), (5, 16), (8, 32)]
FBW = [(1.0, 1.0, 0.0), (1.0, 2.0, 0.0), (2.0, 1.0, 0.5), (0.3, 0.5, 0.2)]


def uniform(s: Schedule, f: float, b: float, w: float = 0.0, send: float = 0.0) -> SimResult:
    return simulate(s, StageTimes.uniform(s.num_stages, f, b, w, send))


# ------------------------------------------------------------- closed forms


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", PM)
@pytest.mark.parametrize("f,b,w", FBW)
def test_gpipe_1f1b_bubble(name, p, m, f, b, w):
    r = uniform(build_schedule(name, p, m), f, b, w)
    assert r.step_time == pytest.approx((m + p - 1) * (f + b + w), rel=REL)
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=REL, abs=1e-12)
    assert r.busy == pytest.approx([m * (f + b + w)] * p, rel=REL)
    # idle per rank = (p-1)(F+B), relative to ideal compute (p-1)/m
    assert all(i == pytest.approx((p - 1) * (f + b + w), rel=REL, abs=1e-12) for i in r.idle)


@pytest.mark.parametrize("p,m", PM)
def test_activation_peaks_gpipe_1f1b(p, m):
    one = uniform(build_schedule("1f1b", p, m), 1.0, 2.0)
    assert one.peak_inflight_by_stage == [min(m, p - i) for i in range(p)]
    assert one.peak_inflight == [min(m, p - i) for i in range(p)]
    gp = uniform(build_schedule("gpipe", p, m), 1.0, 2.0)
    assert gp.peak_inflight_by_stage == [m] * p
    assert one.peak_pending_w == [0] * p


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 9), (8, 32)])
def test_gpipe_with_communication(p, m):
    c = 0.25
    r = uniform(build_schedule("gpipe", p, m), 1.0, 2.0, 0.0, send=c)
    assert r.step_time == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * c, rel=REL)


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 12, 3), (8, 16, 2), (3, 9, 4), (8, 32, 4)])
@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 2.0), (2.0, 1.0)])
def test_interleaved_bubble(p, m, v, f, b):
    assert m % p == 0
    r = uniform(build_schedule("interleaved", p, m, v), f, b)
    ideal = v * m * (f + b)  # per rank compute
    assert r.busy == pytest.approx([ideal] * p, rel=REL)
    for idle in r.idle:
        assert idle / ideal == pytest.approx((p - 1) / (v * m), rel=REL, abs=1e-12)
    # Megatron's first-stage memory factor 1 + (p-1)/(p v), in units of a whole stage
    # (when m == p every forward is warm-up and the rank holds all v*m).
    assert r.peak_inflight[0] == min(v * p + p - 1, v * m)
    if m > p:
        assert r.peak_inflight[0] / v == pytest.approx(p * (1 + (p - 1) / (p * v)), rel=REL)


@pytest.mark.parametrize("p,m", [(4, 5), (4, 6), (4, 10), (3, 4)])
def test_interleaved_torch_flexible_rounds_keep_the_bubble(p, m):
    # torch accepts m not a multiple of p (m % max(1, m // p) == 0); with m >= p the
    # simulated bubble is still (p-1)/(v m).
    v = 2
    r = uniform(build_schedule("interleaved", p, m, v), 1.0, 2.0)
    assert r.step_time == pytest.approx((v * m + p - 1) * 3.0, rel=REL)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (3, 7), (4, 4), (4, 8), (6, 12), (8, 32)])
@pytest.mark.parametrize(
    "f,b,w",
    [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 2.0, 1.0), (3.0, 2.0, 1.0), (1.0, 1.0, 0.5), (1.0, 1.0, 2.0), (1.0, 2.0, 3.0)],
)
def test_zb_h1_bubble(p, m, f, b, w):
    s = build_schedule("zb-h1", p, m)
    r = uniform(s, f, b, w)
    idle = (p - 1) * max(f, b, f + b - w)
    assert r.step_time == pytest.approx(m * (f + b + w) + idle, rel=REL)
    if w <= min(f, b):
        assert r.idle == pytest.approx([(p - 1) * (f + b - w)] * p, rel=REL)
    # ZB-H1 never loses to 1F1B
    assert r.step_time <= uniform(build_schedule("1f1b", p, m), f, b + w).step_time + 1e-9


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8), (8, 32)])
def test_zb_h1_equal_times_is_a_third_of_1f1b(p, m):
    r = uniform(build_schedule("zb-h1", p, m), 1.0, 1.0, 1.0)
    ideal = 3.0 * m
    assert (r.step_time - ideal) / ideal == pytest.approx((p - 1) / (3 * m), rel=REL)
    # same activation peak as 1F1B; deferred W passes pile up on later ranks
    assert r.peak_inflight == [min(m, p - i) for i in range(p)]
    assert r.peak_pending_w == [min(i + 1, m) for i in range(p)]


@pytest.mark.parametrize("p,m", [(2, 3), (2, 6), (3, 5), (4, 7), (4, 8), (6, 12), (8, 32)])
def test_zbv_equal_times(p, m):
    assert m >= 2 * p - 1
    f = 0.5
    r = uniform(build_schedule("zbv", p, m, 2), f, f, f)
    assert r.step_time == pytest.approx(6 * m * f + (p - 1) * f, rel=REL)
    # activation peak: 2p chunk-microbatches per rank = p whole-stage microbatches (1F1B's rank 0)
    assert r.peak_inflight == [2 * p] * p


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (4, 4, 2), (4, 8, 2), (4, 7, 2), (3, 9, 3), (8, 16, 2)])
@pytest.mark.parametrize("f,b,w", [(1.0, 1.0, 1.0), (2.0, 2.0, 1.0), (3.0, 1.0, 1.0), (1.0, 2.0, 3.0)])
def test_interleaved_zero_bubble(p, m, v, f, b, w):
    r = uniform(build_schedule("interleaved-zb", p, m, v), f, b, w)
    assert r.step_time == pytest.approx(v * m * (f + b + w) + (p - 1) * max(f, b, f + b - w), rel=REL)


def test_single_rank_has_no_bubble():
    for name in SCHEDULES:
        v = 2 if name in ("zbv", "dualpipev", "interleaved", "interleaved-zb") else 1
        m = 4
        if schedule_constraints(name, 1, m, v):
            continue
        r = uniform(build_schedule(name, 1, m, v), 1.0, 2.0, 0.5, send=7.0)
        assert r.bubble_fraction == pytest.approx(0.0, abs=1e-12), name
        assert r.step_time == pytest.approx(v * m * 3.5, rel=REL)


# ------------------------------------------------------------- invariants


@st.composite
def case(draw):
    name = draw(st.sampled_from(list(SCHEDULES)))
    v = draw(st.sampled_from({"zbv": [2], "dualpipev": [2], "interleaved": [2, 3], "interleaved-zb": [2, 3], "looped-bfs": [1, 2]}.get(name, [1])))
    p = draw(st.integers(1, 5))
    m = draw(st.integers(1, 12))
    assume(not schedule_constraints(name, p, m, v))
    S = p * v
    t = st.floats(0.0, 3.0, allow_nan=False)
    times = StageTimes(
        fwd=draw(st.lists(st.floats(0.01, 3.0), min_size=S, max_size=S)),
        bwd_input=draw(st.lists(st.floats(0.01, 3.0), min_size=S, max_size=S)),
        bwd_weight=draw(st.lists(t, min_size=S, max_size=S)),
        send_fwd=draw(st.lists(t, min_size=S - 1, max_size=S - 1)),
        send_bwd=draw(st.lists(t, min_size=S - 1, max_size=S - 1)),
    )
    return build_schedule(name, p, m, v), times


def _dur(times: StageTimes, a: Action) -> float:
    return {
        "F": times.fwd[a.stage],
        "B": times.bwd_input[a.stage] + times.bwd_weight[a.stage],
        "I": times.bwd_input[a.stage],
        "W": times.bwd_weight[a.stage],
    }[a.kind]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(case())
def test_timeline_respects_dependencies(c):
    s, times = c
    r = simulate(s, times)
    eps = 1e-9
    ends = {}
    by_rank: dict[int, list] = {}
    for rank, a, start, end in r.timeline:
        assert end == pytest.approx(start + _dur(times, a))
        assert s.rank_of(a.stage) == rank
        ends[(a.kind, a.stage, a.microbatch)] = end
        by_rank.setdefault(rank, []).append((a, start, end))
    assert len(r.timeline) == s.num_actions
    for rank, rows in by_rank.items():
        assert [a for a, _, _ in rows] == list(s.actions[rank]), "ranks run their list in order"
        for (_, _, e0), (_, s1, _) in zip(rows, rows[1:]):
            assert s1 >= e0 - eps, "one compute stream per rank"
    last = s.num_stages - 1

    def grad_end(stage, j):
        return ends.get(("B", stage, j), ends.get(("I", stage, j)))

    for rank, a, start, _ in r.timeline:
        st_, j = a.stage, a.microbatch
        if a.kind == "F" and st_ > 0:
            hop = times.send_fwd[st_ - 1] if s.rank_of(st_ - 1) != rank else 0.0
            assert start >= ends[("F", st_ - 1, j)] + hop - eps
        if a.kind in "BI":
            assert start >= ends[("F", st_, j)] - eps
            if st_ < last:
                hop = times.send_bwd[st_] if s.rank_of(st_ + 1) != rank else 0.0
                assert start >= grad_end(st_ + 1, j) + hop - eps
        if a.kind == "W":
            assert start >= ends[("I", st_, j)] - eps
    # bounds
    assert r.step_time >= max(r.busy) - eps
    assert r.step_time >= critical_path(times, s.stage_to_rank) - eps
    assert r.step_time == pytest.approx(max(e for *_, e in r.timeline))
    assert 0.0 <= r.bubble_fraction < 1.0
    expect_busy = [sum(_dur(times, a) for a in acts) for acts in s.actions]
    assert r.busy == pytest.approx(expect_busy)
    # the fast path agrees
    fast = simulate(s, times, timeline=False)
    assert fast.timeline == [] and fast.step_time == r.step_time and fast.busy == r.busy


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(case())
def test_memory_peaks_follow_the_timeline(c):
    s, times = c
    S = s.num_stages
    act = [float(10 + i) for i in range(S)]
    wg = [float(1 + (i % 3)) for i in range(S)]
    r = simulate(s, times, StageMemory(act, wg))
    # recompute from the timeline: +act at F start, -act (+wg) at B/I end, -wg at W end
    for rank in range(s.num_ranks):
        events = []
        for rk, a, start, end in r.timeline:
            if rk != rank:
                continue
            if a.kind == "F":
                events.append((start, 1, act[a.stage], 1))
            elif a.kind == "B":
                events.append((end, 0, -act[a.stage], -1))
            elif a.kind == "I":
                events.append((end, 0, wg[a.stage] - act[a.stage], -1))
            else:
                events.append((end, 0, -wg[a.stage], 0))
        cur = peak = 0.0
        n = npeak = 0
        for _, _, d, dn in sorted(events):  # releases (0) before acquisitions (1) at equal times
            cur += d
            n += dn
            peak = max(peak, cur)
            npeak = max(npeak, n)
        assert r.peak_bytes[rank] == pytest.approx(peak)
        assert r.peak_inflight[rank] == npeak


def test_peak_bytes_zb_h1_equals_1f1b_on_the_first_rank():
    p, m = 4, 8
    mem = StageMemory(activation=[100.0] * p, wgrad_pending=[40.0] * p)
    zb = simulate(build_schedule("zb-h1", p, m), StageTimes.uniform(p, 1, 1, 1), mem)
    one = simulate(build_schedule("1f1b", p, m), StageTimes.uniform(p, 1, 2), mem)
    assert one.peak_bytes == [100.0 * (p - i) for i in range(p)]
    # rank i holds p-i activations and up to i+1 pending W: (p-i)*100 + ... never above rank 0's
    assert zb.peak_bytes[0] == pytest.approx(100.0 * p)
    assert max(zb.peak_bytes) == pytest.approx(max(one.peak_bytes))
    assert simulate(build_schedule("1f1b", p, m), StageTimes.uniform(p, 1, 2)).peak_bytes is None


def test_pipedream_steady_state():
    p, m = 4, 16
    r = uniform(build_schedule("pipedream", p, m), 1.0, 2.0)
    assert r.steady_state_step_time == pytest.approx(m * 3.0)
    assert r.steady_state_step_time < r.step_time
    assert uniform(build_schedule("1f1b", p, m), 1.0, 2.0).steady_state_step_time is None


# --------------------------------------------------------------- failures


def test_deadlock_is_detected_and_named():
    F, B = "F", "B"
    # rank 1 runs microbatch 1 first; rank 0 needs B(1, 0) before it can send F(0, 1).
    acts = (
        (Action(F, 0, 0), Action(B, 0, 0), Action(F, 0, 1), Action(B, 0, 1)),
        (Action(F, 1, 1), Action(B, 1, 1), Action(F, 1, 0), Action(B, 1, 0)),
    )
    s = Schedule("bad", 2, 2, 2, (0, 1), acts)
    with pytest.raises(ValueError, match=r"deadlocks: .*rank 0 .*B\(stage=0, mb=0\).*rank 1"):
        simulate(s, StageTimes.uniform(2, 1.0, 1.0))


def test_same_rank_deadlock():
    # p=1 with two stages: stage 1's forward listed before stage 0's.
    acts = ((Action("F", 1, 0), Action("F", 0, 0), Action("B", 1, 0), Action("B", 0, 0)),)
    s = Schedule("bad", 1, 2, 1, (0, 0), acts)
    with pytest.raises(ValueError, match="later in its own list"):
        simulate(s, StageTimes.uniform(2, 1.0, 1.0))


def test_malformed_inputs():
    s = build_schedule("1f1b", 4, 8)
    with pytest.raises(ValueError, match="stages"):
        simulate(s, StageTimes.uniform(3, 1.0, 1.0))
    with pytest.raises(ValueError, match="entries"):
        StageTimes(fwd=[1, 1], bwd_input=[1], bwd_weight=[0, 0])
    with pytest.raises(ValueError, match=">= 0"):
        StageTimes(fwd=[1, -1], bwd_input=[1, 1], bwd_weight=[0, 0])
    with pytest.raises(ValueError, match="memory"):
        simulate(s, StageTimes.uniform(4, 1.0, 1.0), StageMemory([1.0] * 3))
    missing = Schedule("x", 1, 1, 2, (0,), ((Action("F", 0, 0), Action("B", 0, 0)),))
    with pytest.raises(ValueError, match="malformed"):
        simulate(missing, StageTimes.uniform(1, 1.0, 1.0))


# ------------------------------------------------------------------ speed


def _best_of(fn, n: int) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def test_speed():
    s = build_schedule("1f1b", 8, 32)
    times = StageTimes.uniform(8, 1.0, 2.0, 0.0, 0.01)
    simulate(s, times)  # compile once
    assert _best_of(lambda: simulate(s, times, timeline=False), 5) < 5e-3
    big = build_schedule("interleaved", 64, 512, 2)
    bt = StageTimes.uniform(128, 1.0, 2.0, 0.0, 0.01)
    simulate(big, bt, timeline=False)
    assert _best_of(lambda: simulate(big, bt, timeline=False), 2) < 1.0
