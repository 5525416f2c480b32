"""One memory answer per pipeline rank: what a split of the pieces into stages needs on each rank, in bytes.

For a split (stage boundaries ``bounds``), rank r holding stages s (one for 1F1B, v for interleaved, two for ZB-V) needs

    need_r = sum_s static_s + max_s transient_s + peak_r * frag + fixed_r
    peak_r = max over the points t of the rank's action order of sum_s held[t][s] * act_s + pending[t][s] * wgrad_s

where ``static_s`` is the held-count-independent bytes of stage s held for the whole step (model state, the pieces'
buffers), ``transient_s`` what the stage allocates and frees while it runs (its working set and point-to-point buffers,
with their fragmentation reserve: a rank runs one stage at a time), ``act_s`` the activation bytes of one micro-batch
of it, ``wgrad_s`` what a deferred weight-gradient pass still reads, ``frag`` 1 + the allocator fragmentation
reserve (charged on what is allocated and freed every micro-batch, never on the model state:
:class:`planner.solve.memory.RuntimeOverhead`), and ``fixed_r`` the runtime reserve (CUDA context, communicators,
feature buffers). ``held[t][s]`` and ``pending[t][s]`` count the
micro-batches of stage s alive (F begun, B/I not ended) and waiting for their W pass after the t-th action of the rank,
exactly as :mod:`planner.solve.simulate` holds them. Those counts depend on the order of the rank's actions only, never
on their times, so one table per (schedule, p, m, v) serves every split; only its Pareto-maximal points can be the peak
(all bytes are >= 0), and those are kept.

:func:`rank_need` is the single function the search's fit check, the rejection's quoted need and plan.json's
``rank_memory`` all read; :func:`solve_split` finds a split that fits by it (see its docstring for what is guaranteed).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TypeVar, cast

import numpy as np

from planner.solve import partition as part
from planner.solve.schedules import build_schedule

T = TypeVar("T")

#: search nodes (stage placements tried) of the exact fallback of :func:`solve_split` before it stops unproven
NODE_LIMIT = 200
#: the same when a cheap proof already says no split fits and the search only looks for the least-overflowing one
QUOTE_NODE_LIMIT = 100
#: explored partial splits remembered per (stage, cut) for the dominance test
MEMO_ROWS = 16


@dataclass(frozen=True)
class RankPoints:
    """The Pareto-maximal (held, pending) counts of one rank's action order.

    Attributes:
        stages: the global stages on the rank, ascending.
        held: (points, len(stages)) micro-batches whose activations each stage holds at that point.
        pending: (points, len(stages)) micro-batches waiting for their weight-gradient pass (0 without an I/W split).
    """

    stages: tuple[int, ...]
    held: np.ndarray
    pending: np.ndarray


@lru_cache(maxsize=512)
def order_points(name: str, p: int, m: int, v: int, group: int = 0) -> tuple[RankPoints, ...]:
    """Per rank, the count points of schedule ``name`` with ``p`` ranks, ``m`` micro-batches, ``v`` stages per rank and
    interleaved micro-batch groups of ``group`` (0: the default).

    Built from the full action order (all ``m`` micro-batches): the counts of interleaved schedules with ``m`` not a
    multiple of ``p``, looped BFS and GPipe keep growing with ``m``, so no shortened step stands for them.
    """
    if name == "gpipe":  # every forward before any backward: one point, all m micro-batches held (v = 1)
        return tuple(RankPoints((r,), np.array([[float(m)]]), np.zeros((1, 1))) for r in range(p))
    sched = build_schedule(name, p, m, v, group)
    out = []
    for acts in sched.actions:
        stages = tuple(sorted({a.stage for a in acts}))
        k = len(stages)
        local = {s: i for i, s in enumerate(stages)}
        cur = [0] * (2 * k)
        seen = {tuple(cur)}
        for a in acts:
            i = local[a.stage]
            if a.kind == "F":
                cur[i] += 1
            elif a.kind == "B":
                cur[i] -= 1
                continue  # a count fell: no new maximum
            elif a.kind == "I":
                cur[i] -= 1
                cur[k + i] += 1
            else:
                cur[k + i] -= 1
                continue
            seen.add(tuple(cur))
        pts = np.array(sorted(seen, key=lambda x: -sum(x)), dtype=np.float64)
        arr = pts[_undominated(pts)]
        out.append(RankPoints(stages, arr[:, :k], arr[:, k:]))
    return tuple(out)


#: elements of the (points x points x counts) comparisons :func:`_undominated` makes at once
_COVER_ELEMENTS = 1 << 22


def _undominated(pts: np.ndarray) -> np.ndarray:
    """Which of the distinct points ``pts`` (one per row) no other point is >= in every count: the Pareto front,
    compared a block of points at a time."""
    n = len(pts)
    keep = np.ones(n, dtype=bool)
    step = max(1, _COVER_ELEMENTS // max(1, n * pts.shape[1]))
    for q0 in range(0, n, step):
        block = pts[q0 : q0 + step]
        covers = np.all(pts[:, None, :] >= block[None, :, :], axis=2)  # [p, q]: point p >= point q0 + q everywhere
        covers[np.arange(q0, q0 + len(block)), np.arange(len(block))] = False  # a point does not dominate itself
        keep[q0 : q0 + len(block)] = ~covers.any(axis=0)
    return keep


@dataclass(frozen=True)
class RankProblem:
    """The memory side of a split: per-range bytes, where each stage sits, and each rank's count points and capacity.

    Attributes:
        static, act, wgrad: (n+1) x (n+1) byte matrices, entry [a, b] for pieces [a, b) (``act`` and ``wgrad``
            without the fragmentation reserve).
        transient: the same for the bytes a stage allocates and frees while it runs, with their fragmentation
            reserve (None: none); a rank needs its stages' largest, not their sum.
        stage_rank: rank of each global stage.
        points: per rank, its :class:`RankPoints`.
        frag: 1 + fragmentation reserve (multiplies the activations and pending weight-gradient inputs, not the static bytes).
        fixed: per rank, bytes of the runtime reserve.
        capacity: per rank, the bytes it may use (device memory x the memory target).
    """

    static: np.ndarray
    act: np.ndarray
    wgrad: np.ndarray
    stage_rank: tuple[int, ...]
    points: tuple[RankPoints, ...]
    frag: float
    fixed: tuple[float, ...]
    capacity: tuple[float, ...]
    transient: np.ndarray | None = None

    @property
    def ranks(self) -> int:
        return len(self.points)


@dataclass(frozen=True)
class RankNeed:
    """Per rank: static bytes of its stages, simulated activation peak, and the total need (bytes)."""

    static: tuple[float, ...]
    peak: tuple[float, ...]
    total: tuple[float, ...]

    def overflow(self, capacity: Sequence[float]) -> tuple[float, int]:
        """The worst need / capacity ratio and its rank (the first of equals)."""
        ratios = [t / c for t, c in zip(self.total, capacity)]
        r = max(range(len(ratios)), key=lambda i: (ratios[i], -i))
        return ratios[r], r


def rank_need(rp: RankProblem, bounds: Sequence[int]) -> RankNeed:
    """Bytes each rank needs for the stages cut at ``bounds`` (the module docstring's formula)."""
    rng = list(zip(bounds, bounds[1:]))
    static, peak, total = [], [], []
    for r, pts in enumerate(rp.points):
        st = sum(float(rp.static[rng[s]]) for s in pts.stages)
        if rp.transient is not None:
            st += max(float(rp.transient[rng[s]]) for s in pts.stages)
        a = np.array([float(rp.act[rng[s]]) for s in pts.stages])
        w = np.array([float(rp.wgrad[rng[s]]) for s in pts.stages])
        pk = float(max(0.0, float(np.max(pts.held @ a + pts.pending @ w))))
        static.append(st)
        peak.append(pk)
        total.append(st + pk * rp.frag + rp.fixed[r])
    return RankNeed(tuple(static), tuple(peak), tuple(total))


def fits(rp: RankProblem, bounds: Sequence[int]) -> bool:
    """Whether every rank's need is within its capacity."""
    return all(t <= c for t, c in zip(rank_need(rp, bounds).total, rp.capacity))


def lower_bound_total(rp: RankProblem, n: int) -> float:
    """A lower bound (bytes) on the sum over ranks of their needs, for any split.

    Every piece's static bytes are on some rank; rank r's peak is at least its count point t's sum, hence at least
    ``h_r = max_t min_s held[t][s]`` times its stages' activations; so the sum is at least
    static(0, n) + frag x min_r h_r x act(0, n) + sum of the fixed reserves.
    """
    h = derived("floor", rp.points, lambda: min(float(np.max(np.min(pts.held, axis=1))) for pts in rp.points))
    return float(rp.static[0, n]) + h * float(rp.act[0, n]) * rp.frag + sum(rp.fixed)


@dataclass(frozen=True)
class SplitResult:
    """What :func:`solve_split` found.

    Attributes:
        bounds: a split that fits every rank, or None.
        closest: the split with the smallest worst need / capacity found (``bounds`` when it fits), None if no split exists.
        proven: whether ``closest`` is proven to overflow least (always true when a fitting split is found, since
            then it overflows by nothing; false when the exact search stopped at its node limit).
        none_fits_proven: with ``bounds`` None, whether no split fits is proven (by the exact DP, a cheap proof or a
            completed search); false when the search stopped at its node limit, so a fitting split may exist.
    """

    bounds: tuple[int, ...] | None
    closest: tuple[int, ...] | None
    proven: bool
    cuttable: bool = True
    none_fits_proven: bool = True


#: answers that depend on a count-points table only, by (what, the table's identity); each entry keeps its table
#: alive, so an identity is never reused while its answers are remembered
_DERIVED: dict[tuple[str, int], tuple[tuple[RankPoints, ...], object]] = {}


def derived(what: str, points: tuple[RankPoints, ...], make: Callable[[], T]) -> T:
    """``make()``, remembered for this ``points`` table (:func:`order_points` shares one between the candidates of a
    schedule, so what follows from the counts alone is worked out once per table)."""
    key = (what, id(points))
    hit = _DERIVED.get(key)
    if hit is not None and hit[0] is points:
        return cast(T, hit[1])
    value = make()
    if len(_DERIVED) >= 4096:
        _DERIVED.clear()
    _DERIVED[key] = (points, value)
    return value


def stage_held(points: tuple[RankPoints, ...], S: int) -> list[float]:
    """Per stage, the most micro-batches of activations it holds at any point of its rank's order."""

    def make() -> tuple[float, ...]:
        held = [0.0] * S
        for pts in points:
            for i, s in enumerate(pts.stages):
                held[s] = float(pts.held[:, i].max())
        return tuple(held)

    return list(derived(f"held/{S}", points, make))


def _stage_points(rp: RankProblem) -> list[tuple[tuple[float, float], ...]]:
    """Per global stage, the (held, pending) counts of its rank's points restricted to it (deduplicated)."""
    S = len(rp.stage_rank)

    def make() -> tuple[tuple[tuple[float, float], ...], ...]:
        out: list[tuple[tuple[float, float], ...]] = [()] * S
        for pts in rp.points:
            for i, s in enumerate(pts.stages):
                pairs = sorted({(float(h), float(w)) for h, w in zip(pts.held[:, i], pts.pending[:, i])}, reverse=True)
                out[s] = tuple(q for q in pairs if not any(o != q and o[0] >= q[0] and o[1] >= q[1] for o in pairs))
        return tuple(out)

    return list(derived(f"points/{S}", rp.points, make))


def _ratio_problem(pb: part.PartitionProblem, rp: RankProblem, stage_pts: list[tuple[tuple[float, float], ...]]) -> part.PartitionProblem:
    """A partition problem whose stage 'time' is its memory share of its rank: (own bytes) x (stages on the rank) / budget.

    Its min-max split balances memory; with one stage per rank it is exactly the split with the smallest worst need
    over capacity (the bytes are the rank's need less its fixed reserve)."""
    S = len(rp.stage_rank)
    per_rank = [len(pts.stages) for pts in rp.points]
    mats = []
    own_of: dict[tuple[tuple[float, float], ...], np.ndarray] = {}
    for j in range(S):
        r = rp.stage_rank[j]
        if stage_pts[j] not in own_of:
            own_of[stage_pts[j]] = _own_matrix(rp, stage_pts[j])
        own = own_of[stage_pts[j]]
        if per_rank[r] == 1:
            mats.append((own + rp.fixed[r]) / rp.capacity[r])
        else:
            mats.append(own * per_rank[r] / max(rp.capacity[r] - rp.fixed[r], 1.0))
    zero = np.zeros(pb.n + 1)
    return replace(
        pb, compute=mats, stage_device=list(range(S)), comm_in=[zero] * S, comm_out=[zero] * S, capacity=[math.inf] * S, stage_points=None, held=[0.0] * S
    )


def _own_matrix(rp: RankProblem, pts: tuple[tuple[float, float], ...]) -> np.ndarray:
    """Bytes (with fragmentation) one stage needs on its own over every range: static + max over its count points."""
    peak = np.max([h * rp.act + w * rp.wgrad for h, w in pts], axis=0)
    out: np.ndarray = _alone(rp) + peak * rp.frag
    return out


def _alone(rp: RankProblem) -> np.ndarray:
    """Static bytes of a stage on its own over every range: held + transient."""
    return rp.static if rp.transient is None else rp.static + rp.transient


def solve_split(
    pb: part.PartitionProblem,
    rp: RankProblem,
    node_limit: int = NODE_LIMIT,
    shrink_rounds: int = 8,
    explain: bool = True,
    quote_node_limit: int = QUOTE_NODE_LIMIT,
) -> SplitResult:
    """A split that fits every rank by :func:`rank_need`, as fast as the method below finds, or the one overflowing least.

    One stage per rank (1F1B, GPipe, ZB-H1): a stage's need is its rank's need, so the partition DP with each stage's
    exact need as its memory (static + the max over its count points) gives the fastest split that fits, exactly;
    when none fits, the same DP minimising need / capacity gives the least-overflowing split, exactly.

    Several stages per rank (interleaved, ZB-V): the ranks couple non-adjacent stages. Guaranteed: (1) a returned
    split fits every rank; (2) when one exists and the exact search below completes within ``node_limit`` nodes,
    one is returned; (3) otherwise ``closest`` is the split with the smallest worst need / capacity, proven when the
    search completed (``proven``). Not guaranteed: the smallest bottleneck time among all fitting splits. Method:
    the DP (fastest split) with every stage limited by its own need to its rank's budget, whose solution is checked
    by rank need; the budgets of overflowing ranks' stages shrink in proportion and the DP runs again (at most
    ``shrink_rounds`` times); if no round fits, a depth-first branch and bound over the stage boundaries minimises
    the worst need / capacity (pruned by the incumbent, by the average need over all ranks, and by dominance: a
    partial split reaching a cut with every partial rank sum at least that of one already explored from there
    cannot do better), seeded with the DP splits. When a cheap proof says no split fits (no stage fits even alone, or a
    sum DP over the ranks' needs at one count point each, :func:`_min_sum`, exceeds the number of ranks), the search
    only looks for the least-overflowing split, within ``quote_node_limit`` nodes, and ``explain=False`` skips it
    (``closest`` is then None).
    """
    S, n = len(rp.stage_rank), pb.n
    if not part.cuttable(pb.allowed, S):
        return SplitResult(None, None, True, cuttable=False)  # the pieces cannot be cut into S stages at the allowed cuts
    stage_pts = _stage_points(rp)
    budget = [rp.capacity[rp.stage_rank[j]] - rp.fixed[rp.stage_rank[j]] for j in range(S)]
    mem_pb = replace(pb, static_mem=_alone(rp), act_mem=rp.act * rp.frag, wgrad_mem=rp.wgrad * rp.frag, stage_points=stage_pts, capacity=budget)
    one_each = all(len(pts.stages) == 1 for pts in rp.points)
    seeds: list[tuple[int, ...]] = []
    sol = part.solve(mem_pb)
    for _ in range(0 if one_each else shrink_rounds):
        if sol is None:
            break
        seeds.append(sol.bounds)
        need = rank_need(rp, sol.bounds)
        over = [r for r in range(rp.ranks) if need.total[r] > rp.capacity[r]]
        if not over:
            break
        caps = list(mem_pb.capacity)
        for j in range(S):
            r = rp.stage_rank[j]
            if r in over:
                caps[j] = min(caps[j], sol.memory[j] * (rp.capacity[r] - rp.fixed[r]) / (need.total[r] - rp.fixed[r]) * 0.999)
        mem_pb = replace(mem_pb, capacity=caps)
        sol = part.solve(mem_pb)
    if sol is not None and fits(rp, sol.bounds):
        return SplitResult(sol.bounds, sol.bounds, True)
    # none fits when: one stage per rank (the exact DP found none), no stage fits even alone, or by _min_sum
    none = one_each or not seeds or _proven_none(rp, pb.allowed, n, seeds[-1:])
    if none and not explain:
        return SplitResult(None, None, one_each)
    balanced = part.solve(_ratio_problem(pb, rp, stage_pts)) if explain else None
    if one_each and balanced is not None:
        ok = fits(rp, balanced.bounds)
        return SplitResult(balanced.bounds if ok else None, balanced.bounds, True)
    fastest = part.solve(replace(pb, capacity=[math.inf] * S))
    seeds += [x.bounds for x in (balanced, fastest) if x is not None]
    best, proven = _branch_and_bound(rp, pb.allowed, n, seeds, quote_node_limit if none else node_limit)
    if fits(rp, best):
        return SplitResult(best, best, True)
    return SplitResult(None, best, proven, none_fits_proven=none or proven)


def _min_sum(rp: RankProblem, allowed: np.ndarray, n: int, point: Sequence[int]) -> float:
    """The smallest, over all splits, of sum_r (need_r - fixed_r) / (capacity_r - fixed_r) with each rank's peak taken at
    its count point ``point[r]`` only (a lower bound of its need): a sum DP over the stage boundaries.

    A split that fits has every term <= 1, so a result above the number of ranks proves that none fits.
    The DP runs over the allowed cuts only (the matrices gathered at them; a boundary elsewhere is never feasible)."""
    S = len(rp.stage_rank)
    ok = np.asarray(allowed, dtype=bool).copy()
    ok[0] = ok[n] = True
    cuts = np.flatnonzero(ok)
    N = len(cuts) - 1
    at = np.ix_(cuts, cuts)
    static, act, wgrad = rp.static[at], rp.act[at], rp.wgrad[at]
    trans = rp.transient[at] if rp.transient is not None else np.zeros_like(static)
    if S > N:
        return math.inf
    # stage j starts at a cut in [j, j + W) and ends at one in [j + 1, j + 1 + W): a partial sum elsewhere cannot be
    # completed (each stage holds at least one range, only the last ends at n), as in partition.solve
    W = N - S + 1
    upper = np.tri(W, dtype=bool).T  # start row r before end column c: a < b
    f = np.full(N + 1, math.inf)
    f[0] = 0.0
    for j in range(S):
        r = rp.stage_rank[j]
        pts = rp.points[r]
        i = pts.stages.index(j)
        h, w = pts.held[point[r], i], pts.pending[point[r], i]
        rows, cols = slice(j, j + W), slice(j + 1, j + 1 + W)
        # a rank's largest transient bytes are at least the mean of its stages': each stage is charged its share
        cost = (static[rows, cols] + trans[rows, cols] / len(pts.stages) + (h * act[rows, cols] + w * wgrad[rows, cols]) * rp.frag) / (
            rp.capacity[r] - rp.fixed[r]
        )
        cand = np.where(upper, f[rows, None] + cost, math.inf)
        f = np.full(N + 1, math.inf)
        f[cols] = cand.min(axis=0)
        if j < S - 1:
            f[N] = math.inf
    return float(f[N])


def _proven_none(rp: RankProblem, allowed: np.ndarray, n: int, splits: Sequence[tuple[int, ...]]) -> bool:
    """Whether :func:`_min_sum` proves that no split fits, with each rank's point the one binding in one of ``splits``."""
    if any(c <= f for c, f in zip(rp.capacity, rp.fixed)):
        return True  # a rank has no room for any bytes
    for bd in splits:
        rng = list(zip(bd, bd[1:]))
        point = []
        for pts in rp.points:
            a = np.array([float(rp.act[rng[s]]) for s in pts.stages])
            w = np.array([float(rp.wgrad[rng[s]]) for s in pts.stages])
            point.append(int(np.argmax(pts.held @ a + pts.pending @ w)))
        if _min_sum(rp, allowed, n, point) > rp.ranks:
            return True
    return False


def _branch_and_bound(rp: RankProblem, allowed: np.ndarray, n: int, seeds: Sequence[tuple[int, ...]], node_limit: int) -> tuple[tuple[int, ...], bool]:
    """The split minimising the worst need / capacity (stopping at the first that fits), and whether the search completed."""
    S = len(rp.stage_rank)
    ok_cut = np.asarray(allowed, dtype=bool).copy()
    ok_cut[0] = ok_cut[n] = True
    inner = [int(b) for b in np.flatnonzero(ok_cut[1:n]) + 1]  # the allowed cuts strictly inside, ascending
    # the ends of stage j < S - 1 starting at cut a: the inner cuts after a that leave at least S - j - 2 inner cuts
    # after them (cut inner[i] has len(inner) - 1 - i after it), a slice of ``inner``
    local = []
    for j in range(S):
        pts = rp.points[rp.stage_rank[j]]
        i = pts.stages.index(j)
        local.append((pts.held[:, i] * rp.frag, pts.pending[:, i] * rp.frag))
    static_f = rp.static
    trans_f = rp.transient if rp.transient is not None else np.zeros_like(rp.static)
    # the matrices' columns at the inner cuts (then n), so a node's ends are a slice, not a gather
    ends_at = np.array(inner + [n], dtype=np.int64)
    static_at, act_at, wgrad_at, trans_at = (x[:, ends_at] for x in (static_f, rp.act, rp.wgrad, trans_f))
    static_to_n = static_f[ends_at, n]
    cap = np.array(rp.capacity)
    fixed = np.array(rp.fixed)
    total_cap = float(cap.sum())
    fixed_sum = float(fixed.sum())
    seed = min(seeds, key=lambda bd: rank_need(rp, bd).overflow(rp.capacity)[0])
    best = [rank_need(rp, seed).overflow(rp.capacity)[0]]  # the incumbent's worst need / capacity
    best_b = [seed]
    nodes = [0]
    complete = [True]
    memo: dict[tuple[int, int], np.ndarray] = {}  # (stage, cut) -> rows of explored partial sums (all ranks, flattened)
    bounds = [0] * (S + 1)
    bounds[S] = n

    def worst(acc: list[np.ndarray], tmax: list[float]) -> float:
        return max(float((acc[r].max() + tmax[r] + fixed[r]) / cap[r]) for r in range(len(acc)))

    def dominated(key: tuple[int, int], flat: np.ndarray) -> bool:
        old = memo.get(key)
        return old is not None and bool(np.any(np.all(old <= flat, axis=1)))

    def visit(j: int, a: int, acc: list[np.ndarray], tmax: list[float], accmax: list[float]) -> bool:
        """Place stages j.. from cut a (``acc``: each rank's held bytes per count point so far, ``tmax``: its largest
        transient bytes so far, ``accmax``: the largest of each rank's ``acc``); True when a fitting split was found
        (stop)."""
        if j == S:
            w = worst(acc, tmax)
            if w < best[0]:
                best[0], best_b[0] = w, tuple(bounds)
            return w <= 1.0
        nodes[0] += 1
        if nodes[0] > node_limit:
            complete[0] = False
            return False
        key = (j, a)
        flat = np.concatenate([*acc, np.asarray(tmax)])  # a partial split no better in any rank's sums or transient max is dominated
        if dominated(key, flat):
            return False
        r = rp.stage_rank[j]
        held, pend = local[j]
        last = j == S - 1
        # the columns of ``ends_at`` this stage may end at: n for the last stage, else a slice of the inner cuts
        lo, hi = (len(inner), len(inner) + 1) if last else (bisect.bisect_right(inner, a), max(0, len(inner) - S + j + 2))
        was_complete = complete[0]
        if lo >= hi:
            return False
        bs = ends_at[lo:hi]
        new_r = acc[r][:, None] + static_at[a, lo:hi][None, :] + held[:, None] * act_at[a, lo:hi][None, :] + pend[:, None] * wgrad_at[a, lo:hi][None, :]
        new_t = np.maximum(tmax[r], trans_at[a, lo:hi])
        col_max = new_r.max(axis=0)
        top = col_max + new_t
        w_r = (top + fixed[r]) / cap[r]
        # the average over ranks: the rest of the pieces' static bytes land on some rank
        others = sum(accmax[q] + tmax[q] for q in range(len(acc)) if q != r) + fixed_sum
        lb = (others + top + static_to_n[lo:hi]) / total_cap
        keep = np.nonzero(np.maximum(w_r, lb) < best[0])[0]
        for i in keep[::-1]:  # the largest stage first: it leaves the least to the stages after it
            if w_r[i] >= best[0] or lb[i] >= best[0]:
                continue  # the incumbent improved meanwhile
            bounds[j + 1] = int(bs[i])
            nxt, nxt_t, nxt_m = list(acc), list(tmax), list(accmax)
            nxt[r] = new_r[:, i]
            nxt_t[r] = float(new_t[i])
            nxt_m[r] = float(col_max[i])
            if visit(j + 1, int(bs[i]), nxt, nxt_t, nxt_m):
                return True
        if complete[0] and was_complete:
            old = memo.get(key)
            memo[key] = flat[None, :] if old is None else np.vstack([old[-MEMO_ROWS + 1 :], flat[None, :]])
        return False

    start = [np.zeros(len(pts.held)) for pts in rp.points]
    found = visit(0, 0, start, [0.0] * len(rp.points), [0.0] * len(rp.points))
    return best_b[0], found or complete[0]
