"""One memory answer per pipeline rank (planner.solve.rank_memory), checked against the event simulator and brute force.

The references are independent of the count-point table the search reads: a rank's need is recomputed from
``simulate(...).peak_bytes`` (the simulator's own running sum over the action list, with real or uniform times) plus
its stages' static bytes, and the splits are enumerated exhaustively.
"""

import itertools
import math
import os
import zlib

import numpy as np
import pytest

from planner.solve import partition as part
from planner.solve import rank_memory as rmem
from planner.solve.schedules import SCHEDULE_INFO, build_schedule, schedule_constraints
from planner.solve.search import _points_m
from planner.solve.simulate import StageMemory, StageTimes, simulate

SEED = os.environ.get("RANK_MEMORY_SEED", "")  # another value draws other instances
SPLIT_SCHEDULES = [("1f1b", 1), ("zb-h1", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved", 3), ("interleaved-zb", 2), ("zbv", 2), ("dualpipev", 2)]


def _matrix(prefix: np.ndarray) -> np.ndarray:
    return prefix[None, :] - prefix[:, None]


def _reference_need(name, p, m, v, static, act, wgrad, frag, fixed, bounds, times=None, transient=None):
    """Per rank: its stages' static bytes + the largest of their transient bytes + the simulator's activation peak x
    frag + fixed."""
    sched = build_schedule(name, p, m, v)
    rng = list(zip(bounds, bounds[1:]))
    S = p * v
    mem = StageMemory(tuple(float(act[r]) for r in rng), tuple(float(wgrad[r]) for r in rng))
    times = times or StageTimes.uniform(S, 1.0, 1.0, 1.0)
    peaks = simulate(sched, times, mem, timeline=False).peak_bytes
    st = [0.0] * p
    top = [0.0] * p
    for j, r in enumerate(rng):
        st[sched.stage_to_rank[j]] += float(static[r])
        if transient is not None:
            top[sched.stage_to_rank[j]] = max(top[sched.stage_to_rank[j]], float(transient[r]))
    st = [a + b for a, b in zip(st, top)]
    return [st[r] + peaks[r] * frag + fixed[r] for r in range(p)]


def _random_times(rng, S):
    return StageTimes(rng.uniform(0.1, 3, S), rng.uniform(0.1, 3, S), rng.uniform(0.1, 3, S), rng.uniform(0, 1, S - 1), rng.uniform(0, 1, S - 1))


@pytest.mark.parametrize("name,v", SPLIT_SCHEDULES + [("looped-bfs", 2)])
def test_peak_depends_on_the_order_only_and_matches_the_simulator(name, v):
    """The count points give the simulator's peak, and the simulator's peak is the same with uniform and random times."""
    rng = np.random.default_rng(7)
    for p in (2, 3, 4):
        for m in (p, 2 * p, 2 * p + 1, 3 * p):
            if schedule_constraints(name, p, m, v):
                continue
            S = p * v
            sched = build_schedule(name, p, m, v)
            pts = rmem.order_points(name, p, m, v)
            for _ in range(3):
                act, wg = rng.uniform(0, 10, S), rng.uniform(0, 10, S)
                mem = StageMemory(tuple(act), tuple(wg))
                uniform = simulate(sched, StageTimes.uniform(S, 1.0, 1.0, 1.0), mem, timeline=False).peak_bytes
                real = simulate(sched, _random_times(rng, S), mem, timeline=False).peak_bytes
                assert real == pytest.approx(uniform, rel=1e-12)
                for r, q in enumerate(pts):
                    ours = float(np.max(q.held @ act[list(q.stages)] + q.pending @ wg[list(q.stages)]))
                    assert ours == pytest.approx(uniform[r], rel=1e-12)
                    assert q.stages == tuple(s for s in range(S) if sched.stage_to_rank[s] == r)


@pytest.mark.parametrize("name", [n for n in SCHEDULE_INFO if not SCHEDULE_INFO[n].analysis_only])
def test_the_shortened_order_has_the_same_count_points(name):
    """search._points_m shortens the step only where the Pareto points of the counts do not change with m."""
    for p in range(2, 7):
        for v in (1, 2, 3):
            for m in range(1, 5 * p + 1):
                if schedule_constraints(name, p, m, v):
                    continue
                short = _points_m(name, p, m)
                a, b = rmem.order_points(name, p, m, v), rmem.order_points(name, p, short, v)
                for x, y in zip(a, b):
                    kx = sorted(map(tuple, np.hstack([x.held, x.pending])))
                    ky = sorted(map(tuple, np.hstack([y.held, y.pending])))
                    assert kx == ky, (name, p, m, v, short)


def _instance(rng, name, p, v, n, tight):
    """A random split problem: piece bytes and times, allowed cuts, per-rank capacities around the typical need."""
    S = p * v
    m = 2 * p if name != "dualpipev" else 2 * p
    static = _matrix(np.concatenate([[0.0], np.cumsum(rng.uniform(0, 10, n))]))
    act = _matrix(np.concatenate([[0.0], np.cumsum(rng.uniform(0, 4, n))]))
    wgrad = _matrix(np.concatenate([[0.0], np.cumsum(rng.uniform(0, 2, n))])) if SCHEDULE_INFO[name].split_backward else np.zeros((n + 1, n + 1))
    allowed = np.concatenate([[True], rng.random(n - 1) < 0.8, [True]])
    # transient bytes as memory.transient_matrix builds them: the range's largest piece working set + its boundaries'
    trans = 2.0 * np.add.outer(rng.uniform(0, 1, n + 1), np.zeros(n + 1))
    trans = trans + trans.T
    ws = rng.uniform(0, 8, n)
    for a in range(n):
        trans[a, a + 1 :] += np.maximum.accumulate(ws[a:])
    frag, fixed = 1.0 + rng.uniform(0, 0.2), tuple(rng.uniform(0, 5, p))
    sched = build_schedule(name, p, m, v)
    points = rmem.order_points(name, p, m, v)
    rp = rmem.RankProblem(static, act, wgrad, tuple(sched.stage_to_rank), points, frag, fixed, (math.inf,) * p, trans)
    even = tuple(int(round(x)) for x in np.linspace(0, n, S + 1))
    typical = max(rmem.rank_need(rp, even).total)  # the most loaded rank of an even split
    rp = rmem.RankProblem(
        static, act, wgrad, tuple(sched.stage_to_rank), points, frag, fixed, tuple(typical * tight * rng.uniform(0.9, 1.1) for _ in fixed), trans
    )
    t = np.concatenate([[0.0], np.cumsum(rng.uniform(0.1, 1, n))])
    zero = np.zeros(n + 1)
    cut = rng.uniform(0, 0.3, n + 1)
    pb = part.PartitionProblem(
        compute=[t],
        stage_device=[0] * S,
        comm_in=[zero] + [cut] * (S - 1),
        comm_out=[cut] * (S - 1) + [zero],
        static_mem=static,
        act_mem=act,
        held=[1.0] * S,
        capacity=[math.inf] * S,
        allowed=allowed,
    )
    return pb, rp, m


def _all_splits(allowed, n, S):
    cuts = [k for k in range(1, n) if allowed[k]]
    for inner in itertools.combinations(cuts, S - 1):
        yield (0,) + inner + (n,)


@pytest.mark.parametrize("name,v", SPLIT_SCHEDULES)
def test_search_finds_a_fit_iff_brute_force_does_and_quotes_the_least_overflow(name, v):
    """(a) a fitting split is found iff one exists; (b) without one, the quoted split's worst need / capacity is the
    minimum over all splits; (c) the verdict is the simulator-based need of the chosen split. 1F1B-like schedules
    (one stage per rank) also get the fastest fitting split, exactly."""
    rng = np.random.default_rng(zlib.crc32(f"{name}{v}{SEED}".encode()))
    seen = {True: 0, False: 0}
    for trial in range(40):
        p = int(rng.integers(2, 4))
        S = p * v
        n = int(rng.integers(S, S + 5))
        pb, rp, m = _instance(rng, name, p, v, n, tight=float(rng.uniform(0.6, 1.6)))
        splits = list(_all_splits(pb.allowed, n, S))
        res = rmem.solve_split(pb, rp, node_limit=10**6, quote_node_limit=10**6)  # let the exact search complete
        if not splits:
            assert res.bounds is None and res.closest is None
            continue
        ref = {bd: _reference_need(name, p, m, v, rp.static, rp.act, rp.wgrad, rp.frag, rp.fixed, bd, transient=rp.transient) for bd in splits}
        ratio = {bd: max(t / c for t, c in zip(need, rp.capacity)) for bd, need in ref.items()}
        fitting = [bd for bd in splits if ratio[bd] <= 1.0]
        seen[bool(fitting)] += 1
        assert (res.bounds is not None) == bool(fitting), (trial, name, p, v, n)
        if res.bounds is not None:
            assert ratio[res.bounds] <= 1.0
            assert list(rmem.rank_need(rp, res.bounds).total) == pytest.approx(ref[res.bounds], rel=1e-12)
            if v == 1:
                fastest = min(max(part.stage_time(pb, j, a, b) for j, (a, b) in enumerate(zip(bd, bd[1:]))) for bd in fitting)
                ours = max(part.stage_time(pb, j, a, b) for j, (a, b) in enumerate(zip(res.bounds, res.bounds[1:])))
                assert ours == pytest.approx(fastest, rel=1e-12)
        else:
            assert res.proven
            assert ratio[res.closest] == pytest.approx(min(ratio.values()), rel=1e-12)
    assert seen[True] >= 5 and seen[False] >= 5, seen  # both answers were exercised


def test_a_search_stopped_at_its_node_limit_does_not_claim_that_no_split_fits():
    """With the branch and bound cut short (one node), ``none_fits_proven`` is true only where brute force finds no
    fitting split, and a fitting split it missed is reported as possibly existing (several stages per rank)."""
    missed = proven = 0
    for name, v in [x for x in SPLIT_SCHEDULES if x[1] > 1]:
        rng = np.random.default_rng(zlib.crc32(f"stop{name}{v}{SEED}".encode()))
        for _ in range(40):
            p = int(rng.integers(2, 4))
            S = p * v
            n = int(rng.integers(S, S + 5))
            pb, rp, m = _instance(rng, name, p, v, n, tight=float(rng.uniform(0.6, 1.6)))
            splits = list(_all_splits(pb.allowed, n, S))
            res = rmem.solve_split(pb, rp, node_limit=1, quote_node_limit=1)
            if not splits or res.bounds is not None:
                continue
            exists = any(max(t / c for t, c in zip(rmem.rank_need(rp, bd).total, rp.capacity)) <= 1.0 for bd in splits)
            assert not (res.none_fits_proven and exists), (name, v, p, n)
            missed += exists
            proven += res.none_fits_proven
    assert missed >= 1 and proven >= 1, (missed, proven)  # both answers were exercised


@pytest.mark.parametrize("name,v", SPLIT_SCHEDULES)
def test_the_necessary_condition_is_a_lower_bound(name, v):
    """lower_bound_total never exceeds the ranks' needs summed, for any split, so its shortcut never rejects a fit."""
    rng = np.random.default_rng(11)
    for _ in range(10):
        p = int(rng.integers(2, 4))
        S = p * v
        n = S + 3
        pb, rp, m = _instance(rng, name, p, v, n, tight=1.0)
        lb = rmem.lower_bound_total(rp, n)
        for bd in _all_splits(np.ones(n + 1, bool), n, S):
            assert lb <= sum(_reference_need(name, p, m, v, rp.static, rp.act, rp.wgrad, rp.frag, rp.fixed, bd, transient=rp.transient)) * (1 + 1e-12)


def _simulated_totals(ev, ctx):
    """Each rank's need recomputed from the evaluation's own simulation (real stage times, all micro-batches): the model
    state as it is, the working set and buffers and the activation peak with the fragmentation reserve, the fixed reserve."""
    from planner.solve.search import feature_buffers

    o = ctx.opts.knobs.overhead
    lay = ev.layout
    fixed = o.context + o.communicator + feature_buffers(ctx.costs, lay)
    assert lay.num_microbatches * lay.pp * lay.vp <= 20000  # simulated in full, not extrapolated
    trans = ctx.transient(lay.micro_batch, lay.tp, lay.recompute, lay.sequence_parallel, lay.cp, lay.fp8, lay.ep, lay.etp, lay.modules_recomputed)
    rng = list(zip(ev.bounds, ev.bounds[1:]))
    out = []
    for r in range(lay.pp):
        js = [j for j in range(len(ev.stage_rank)) if ev.stage_rank[j] == r]
        state = sum(ev.stage_memory[j][k] for j in js for k in ("weights", "grads", "optimizer"))
        # the pieces' buffers are held all step; one stage's working set and p2p buffers at a time, with the reserve
        t = [float(trans[rng[j]]) for j in js]
        held_buffers = sum(ev.stage_memory[j]["buffers"] for j in js) - sum(t)
        out.append(state + held_buffers + (max(t) + ev.sim.peak_bytes[r]) * (1 + o.fragmentation) + fixed)
    return out


def test_a_rejected_published_layout_quotes_the_simulated_peak_of_its_split():
    """N-gpt3-175b-128 (NeMo 24.07: gpt3-175b, 128 H100, tp 4, pp 8, vp 6, mb 1, gbs 256) at a memory target below what
    its fastest split needs (it fits at 1.0): the rejection's need is the most loaded rank of the split it names, priced
    with the check lifted and recomputed from the simulator, and no more than the fastest split's."""
    from bench import published_runs as pr
    from planner import hardware
    from planner.engines import get_engine
    from planner.solve.memory import GiB
    from planner.solve.rules import RejectKind
    from planner.solve.search import Context, Rejection, evaluate_layout, memory_rejection, price_layout
    from planner.solve.settings import Settings

    run = next(r for r in pr.RUNS_ALL if r.id == "N-gpt3-175b-128")
    costs, lay = pr.costs_for(run), pr.layout_for(run)
    cluster = hardware.parse_gpus(f"{run.gpus}x{pr.DEVICE_PROFILE[run.source.device]}")

    def ctx(target):
        return Context(
            costs,
            cluster,
            Settings.of(engine="megatron", global_batch=run.global_batch, mem_target=target, cp=run.cp, fp8=lay.fp8, main_grads_dtype=lay.main_grads_dtype),
            get_engine("megatron"),
        )

    fastest = evaluate_layout(ctx(pr.UNCHECKED), lay, costs.dtype)
    cap = fastest.capacity[0]
    target = max(m["total"] for m in fastest.rank_memory) / cap
    rej = None
    for _ in range(20):  # lower the target until no split fits
        target *= 0.97
        res = evaluate_layout(ctx(target), lay, costs.dtype)
        if isinstance(res, Rejection):
            rej = res
            break
    assert isinstance(rej, Rejection) and rej.kind is RejectKind.MEMORY and rej.bounds is not None
    same = price_layout(ctx(target), lay, costs.dtype, bounds=rej.bounds)
    totals = [m["total"] for m in same.rank_memory]
    assert max(totals) == rej.need_bytes
    assert rej.need_bytes > target * cap
    assert totals == pytest.approx(_simulated_totals(same, ctx(target)), rel=1e-9)
    assert memory_rejection(same, target).need_bytes == rej.need_bytes
    worst = totals.index(max(totals))
    assert f"pipeline rank {worst} (stages {', '.join(str(j) for j in range(worst, 48, 8))}) needs {rej.need_bytes / GiB:.1f} GiB" in rej.reason
    assert rej.need_bytes <= max(m["total"] for m in fastest.rank_memory)


def test_an_accepted_interleaved_plan_reports_the_simulated_rank_need(gpt2xl):
    """The fit check's verdict and plan.json's rank_memory are the simulator's per-rank need of the chosen split."""
    from planner import hardware
    from planner.engines import get_engine
    from planner.solve.plan import Layout
    from planner.solve.search import Context, Evaluation, evaluate_layout, memory_rejection
    from planner.solve.settings import Settings

    cluster = hardware.parse_gpus("8xA100")
    ctx = Context(gpt2xl, cluster, Settings.of(engine="megatron"), get_engine("megatron"))
    lay = Layout("megatron", 4, 1, 2, 2, 1, 12, 24, "interleaved", "none", 1)
    ev = evaluate_layout(ctx, lay, "bf16")
    assert isinstance(ev, Evaluation)
    assert [m["total"] for m in ev.rank_memory] == pytest.approx(_simulated_totals(ev, ctx), rel=1e-9)
    assert memory_rejection(ev, 0.85) is None
    assert all(m["total"] <= 0.85 * c for m, c in zip(ev.rank_memory, ev.capacity))


def test_a_rank_of_several_stages_holds_one_stage_working_set_at_a_time(gpt2xl):
    """Interleaved, two stages per rank: each rank's buffers are its stages' module buffers summed plus the largest of
    their transient bytes, 2 x (bytes of its two boundary cuts) + the range's largest operator output, recomputed here
    from the layer records; so less than the stages' buffers summed (the working set is not held twice). Megatron
    computes the loss inside the model: the model's input and output (cuts 0 and n) take no buffers."""
    from planner import hardware
    from planner.engines import get_engine
    from planner.solve.plan import Layout
    from planner.solve.search import Context, Evaluation, evaluate_layout
    from planner.solve.settings import Settings

    cluster = hardware.parse_gpus("8xA100")
    ctx = Context(gpt2xl, cluster, Settings.of(engine="megatron", mem_target=100.0), get_engine("megatron"))
    lay = Layout("megatron", 4, 1, 2, 2, 1, 12, 24, "interleaved", "none", 1)
    ev = evaluate_layout(ctx, lay, "bf16")
    assert isinstance(ev, Evaluation)
    layers = ctx.engine.layer_activations(ctx.sharded(1, 1, True, 1), 1, False, 1, "none").layers
    cuts = ctx.sharded(1, 1, True, 1).cuts
    rng = list(zip(ev.bounds, ev.bounds[1:]))
    for r, mem in enumerate(ev.rank_memory):
        js = [j for j in range(len(rng)) if ev.stage_rank[j] == r]
        held = sum(sum(l.buffer_bytes for l in layers[a:c]) for a, c in (rng[j] for j in js))
        boundary = [0.0 if k in (0, len(layers)) else float(c.bytes) for k, c in enumerate(cuts)]
        trans = [2.0 * (boundary[a] + boundary[c]) + max(l.max_op_bytes for l in layers[a:c]) for a, c in (rng[j] for j in js)]
        assert len(js) == 2 and min(trans) > 0
        assert mem["buffers"] == pytest.approx(held + max(trans), rel=1e-9)
        assert mem["buffers"] < sum(ev.stage_memory[j]["buffers"] for j in js)


def test_the_fragmentation_reserve_is_charged_on_transient_bytes_never_on_the_model_state(gpt2xl):
    """fp32 main gradients in place of bf16 grow the model state (the gradients, and the optimizer's shard) and nothing
    transient: every rank's total grows by exactly that growth (no reserve on it), and each rank's overhead is the fixed
    reserve plus 5% of its activation peak and buffers, in both."""
    from dataclasses import replace

    from planner import hardware
    from planner.engines import get_engine
    from planner.solve.plan import Layout
    from planner.solve.search import Context, Evaluation, evaluate_layout, feature_buffers
    from planner.solve.settings import Settings

    cluster = hardware.parse_gpus("8xA100")
    ctx = Context(gpt2xl, cluster, Settings.of(engine="megatron", mem_target=100.0), get_engine("megatron"))
    lay = Layout("megatron", 2, 1, 4, 1, 1, 8, 32, "1f1b", "none", 1, True, main_grads_dtype="bf16")
    bf16 = evaluate_layout(ctx, lay, "bf16")
    fp32 = evaluate_layout(ctx, replace(lay, main_grads_dtype="fp32"), "bf16")
    assert isinstance(bf16, Evaluation) and isinstance(fp32, Evaluation)
    o = ctx.opts.knobs.overhead
    fixed = o.context + o.communicator + feature_buffers(gpt2xl, lay)
    for a, b in zip(bf16.rank_memory, fp32.rank_memory):
        assert b["grads"] > a["grads"] and b["activations"] == a["activations"] and b["buffers"] == a["buffers"]
        state = sum(b[k] - a[k] for k in ("weights", "grads", "optimizer"))
        assert b["total"] - a["total"] == pytest.approx(state, rel=1e-9) and b["overhead"] == a["overhead"]
        for m in (a, b):
            assert m["overhead"] == pytest.approx(fixed + o.fragmentation * (m["activations"] + m["buffers"]), rel=1e-9)


def _reference_min_sum(rp, allowed, n, point):
    """rank_memory._min_sum as a sum DP over every piece boundary (the non-allowed ones masked): the reference for
    the DP over the allowed cuts only."""
    S = len(rp.stage_rank)
    ok = np.asarray(allowed, dtype=bool).copy()
    ok[0] = ok[n] = True
    idx = np.arange(n + 1)
    upper = idx[:, None] < idx[None, :]
    f = np.full(n + 1, math.inf)
    f[0] = 0.0
    for j in range(S):
        r = rp.stage_rank[j]
        pts = rp.points[r]
        i = pts.stages.index(j)
        h, w = pts.held[point[r], i], pts.pending[point[r], i]
        cost = (rp.static + rp.transient / len(pts.stages) + (h * rp.act + w * rp.wgrad) * rp.frag) / (rp.capacity[r] - rp.fixed[r])
        f = np.where(upper & ok[:, None], f[:, None] + cost, math.inf).min(axis=0)
        if j < S - 1:
            f = np.where(ok, f, math.inf)
            f[n] = math.inf
    return float(f[n])


@pytest.mark.parametrize("name,v", SPLIT_SCHEDULES)
def test_the_sum_proof_over_allowed_cuts_equals_the_one_over_every_boundary(name, v):
    """_min_sum (the cheap proof that no split fits) gives the same number, bit for bit, as the DP over every boundary."""
    rng = np.random.default_rng(zlib.crc32(f"minsum{name}{v}{SEED}".encode()))
    for _ in range(20):
        p = int(rng.integers(2, 4))
        S = p * v
        n = int(rng.integers(S, S + 6))
        pb, rp, m = _instance(rng, name, p, v, n, tight=float(rng.uniform(0.6, 1.6)))
        allowed = np.concatenate([[True], rng.random(n - 1) < 0.6, [True]])
        point = [int(rng.integers(0, len(pts.held))) for pts in rp.points]
        assert rmem._min_sum(rp, allowed, n, point) == _reference_min_sum(rp, allowed, n, point)


@pytest.mark.parametrize("block", [1 << 22, 5, 64])
def test_undominated_is_the_pareto_front(block, monkeypatch):
    """The count points kept are those no other point covers in every count: against the pairwise definition, with
    the comparison made whole or a few points at a time."""
    monkeypatch.setattr(rmem, "_COVER_ELEMENTS", block)
    rng = np.random.default_rng(3)
    for _ in range(50):
        pts = np.unique(rng.integers(0, 4, size=(int(rng.integers(1, 40)), int(rng.integers(1, 5)))).astype(float), axis=0)
        want = [not any(j != i and np.all(pts[j] >= pts[i]) for j in range(len(pts))) for i in range(len(pts))]
        assert rmem._undominated(pts).tolist() == want
