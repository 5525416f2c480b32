"""Exact stage partition: dynamic programming over cut points, minimising the bottleneck stage time.

Stage j runs pieces [a, b) and costs

    time_j(a, b) = compute[d_j](a, b) + comm_in_j[a] + comm_out_j[b]        (seconds per micro-batch)
    mem_j(a, b)  = static(a, b) + held_j * act(a, b)                         (bytes)

where ``d_j`` is the device class of stage j (heterogeneous clusters),
``comm_*`` the point-to-point time of the boundary tensors over the link
between neighbouring stages, ``static`` the held-count-independent bytes
(model state, buffers, overhead), ``act`` the activation bytes of one
micro-batch and ``held_j`` how many micro-batches the schedule keeps alive on
stage j (it depends on the stage's position: 1F1B stage j holds min(m, p-j)).
A partition is feasible when every stage fits its capacity and every cut is an
allowed cut point. The DP is exact: f[j][b] = min over a of max(f[j-1][a],
time_j(a, b)) over feasible stages; ``brute_force`` enumerates every partition
and serves as its reference in the tests.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

INF = float("inf")


@dataclass(frozen=True)
class PartitionProblem:
    """A partition instance over ``n`` pieces and ``len(stage_device)`` stages.

    Attributes:
        compute: per device class, an (n+1) x (n+1) matrix whose [a, b] entry is the
            compute time (seconds) of pieces [a, b) on that device; or a prefix-sum
            vector of length n+1 (then compute[a, b] = prefix[b] - prefix[a]).
        stage_device: device class of each stage.
        comm_in, comm_out: per stage, vectors of length n+1: time added to the stage
            when it starts / ends at cut k (0 where there is no neighbour).
        static_mem, act_mem: (n+1) x (n+1) byte matrices (or prefix vectors).
        held: per stage, micro-batches of activations held at peak.
        capacity: per stage, usable bytes.
        allowed: length n+1, whether a stage boundary may sit at cut k (0 and n are always allowed).
        wgrad_mem: optional (n+1) x (n+1) byte matrix (or prefix vector): what a deferred weight-gradient pass reads.
        stage_points: optional, per stage, (held, pending) count pairs; when given, stage j's memory is
            static + max over its pairs of held x act + pending x wgrad (its exact peak when it is alone on its rank),
            and ``held`` is not read.
    """

    compute: Sequence[np.ndarray]
    stage_device: Sequence[int]
    comm_in: Sequence[np.ndarray]
    comm_out: Sequence[np.ndarray]
    static_mem: np.ndarray
    act_mem: np.ndarray
    held: Sequence[float]
    capacity: Sequence[float]
    allowed: np.ndarray
    wgrad_mem: np.ndarray | None = None
    stage_points: Sequence[Sequence[tuple[float, float]]] | None = None

    @property
    def n(self) -> int:
        return len(self.allowed) - 1

    @property
    def stages(self) -> int:
        return len(self.stage_device)


@dataclass(frozen=True)
class Partition:
    """Stage boundaries ``bounds`` (bounds[0] = 0, bounds[-1] = n), per-stage times and memory, and the bottleneck."""

    bounds: tuple[int, ...]
    times: tuple[float, ...]
    memory: tuple[float, ...]

    @property
    def bottleneck(self) -> float:
        return max(self.times)

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.bounds, self.bounds[1:]))


def _matrix(x: np.ndarray) -> np.ndarray:
    """An (n+1) x (n+1) matrix [a, b] = x[b] - x[a] from a prefix vector, or ``x`` itself."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 2:
        return x
    diff: np.ndarray = x[None, :] - x[:, None]
    return diff


def cuttable(allowed: np.ndarray, stages: int) -> bool:
    """Whether ``len(allowed) - 1`` pieces can be cut into ``stages`` non-empty stages at the ``allowed`` cuts
    (0 and n count as allowed): there are at least ``stages - 1`` allowed cuts strictly inside."""
    n = len(allowed) - 1
    return stages <= n and int(np.count_nonzero(np.asarray(allowed, dtype=bool)[1:n])) >= stages - 1


def _entry(x: np.ndarray, a: int, b: int) -> np.float64:
    """Entry [a, b] of :func:`_matrix` (x) without building the matrix: x[b] - x[a] for a prefix vector."""
    x = np.asarray(x, dtype=np.float64)
    out: np.float64 = x[a, b] if x.ndim == 2 else x[b] - x[a]
    return out


def _at_cuts(x: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """:func:`_matrix` (x) restricted to the rows and columns ``cuts`` (the same numbers, gathered)."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 2:
        sub: np.ndarray = x[np.ix_(cuts, cuts)]
        return sub
    return _matrix(x[cuts])


def stage_time(pb: PartitionProblem, j: int, a: int, b: int) -> float:
    return float(_entry(pb.compute[pb.stage_device[j]], a, b) + pb.comm_in[j][a] + pb.comm_out[j][b])


def _mem_block(pb: PartitionProblem, j: int, static: np.ndarray, act: np.ndarray, wgrad: np.ndarray | None) -> np.ndarray:
    """Stage j's bytes over a block of ranges, from the matching blocks of the static, activation and W-input matrices."""
    if pb.stage_points is None:
        out: np.ndarray = static + pb.held[j] * act
        return out
    w = wgrad if wgrad is not None else np.zeros_like(act)
    pairs = pb.stage_points[j]
    peak = pairs[0][0] * act + pairs[0][1] * w
    for h, q in pairs[1:]:  # the elementwise max over the stage's count points
        np.maximum(peak, h * act + q * w, out=peak)
    res: np.ndarray = static + peak
    return res


def stage_mem(pb: PartitionProblem, j: int, a: int, b: int) -> float:
    def one(x: np.ndarray) -> np.ndarray:
        return np.array([[_entry(x, a, b)]])

    wg = None if pb.wgrad_mem is None else one(pb.wgrad_mem)
    return float(_mem_block(pb, j, one(pb.static_mem), one(pb.act_mem), wg)[0, 0])


def solve(pb: PartitionProblem) -> Partition | None:
    """The partition with the smallest bottleneck stage time, or None when no partition fits.

    Ties are broken towards the earliest boundaries, so the result is deterministic.

    The DP runs over the allowed cuts only (the matrices gathered at them): a stage boundary elsewhere is never
    feasible, so its rows and columns could only hold infinities, and each stage's window of start and end cuts
    (j stages before it, S - j - 1 after it, each holding at least one range between allowed cuts) shrinks to the
    cuts that can lie on a complete partition. The bottleneck and the boundaries are those of the DP over every
    piece boundary (its first minimum among the same finite candidates, in the same order).
    """
    n, S = pb.n, pb.stages
    if S < 1 or S > n:
        return None
    allowed = np.asarray(pb.allowed, dtype=bool).copy()
    allowed[0] = allowed[n] = True
    cuts = np.flatnonzero(allowed)  # positions of the allowed cuts, 0 and n included
    N = len(cuts) - 1  # ranges between consecutive allowed cuts
    if S > N:
        return None
    compute = [_at_cuts(c, cuts) for c in pb.compute]
    static, act = _at_cuts(pb.static_mem, cuts), _at_cuts(pb.act_mem, cuts)
    wgrad = None if pb.wgrad_mem is None else _at_cuts(pb.wgrad_mem, cuts)
    comm_in = [np.asarray(c)[cuts] for c in pb.comm_in]
    comm_out = [np.asarray(c)[cuts] for c in pb.comm_out]
    idx = np.arange(N + 1)
    upper = idx[:, None] < idx[None, :]  # a < b: each stage runs at least one piece
    f = np.full(N + 1, INF)
    f[0] = 0.0
    choice = np.zeros((S, N + 1), dtype=np.int64)
    for j in range(S):
        # stage j starts at cut a in [j, N-S+j] (j stages before it, S-j-1 after it, each non-empty) and ends at b in [j+1, N-S+j+1]
        a0, a1 = j, N - S + j + 1
        b0, b1 = j + 1, N - S + j + 2
        rows, cols = slice(a0, a1), slice(b0, b1)
        t = compute[pb.stage_device[j]][rows, cols] + comm_in[j][rows, None] + comm_out[j][None, cols]
        ok = upper[rows, cols] & (_mem_block(pb, j, static[rows, cols], act[rows, cols], None if wgrad is None else wgrad[rows, cols]) <= pb.capacity[j])
        if j == S - 1:
            ok &= (idx[cols] == N)[None, :]
        cand = np.where(ok, np.maximum(f[rows, None], t), INF)
        best = np.argmin(cand, axis=0)
        f = np.full(N + 1, INF)
        f[cols] = cand[best, np.arange(b1 - b0)]
        choice[j, cols] = best + a0
    if not np.isfinite(f[N]):
        return None
    bounds = [N]
    for j in range(S - 1, -1, -1):
        bounds.append(int(choice[j][bounds[-1]]))
    bounds.reverse()
    return _result(pb, tuple(int(cuts[k]) for k in bounds))


def _result(pb: PartitionProblem, bounds: tuple[int, ...]) -> Partition:
    ranges = list(zip(bounds, bounds[1:]))
    times = tuple(stage_time(pb, j, a, b) for j, (a, b) in enumerate(ranges))
    mems = tuple(stage_mem(pb, j, a, b) for j, (a, b) in enumerate(ranges))
    return Partition(bounds, times, mems)


def evaluate(pb: PartitionProblem, bounds: Sequence[int]) -> tuple[Partition, list[int]]:
    """Times and memory of a given partition, and the stages that exceed their capacity."""
    part = _result(pb, tuple(bounds))
    over = [j for j, m in enumerate(part.memory) if m > pb.capacity[j]]
    return part, over


def brute_force(pb: PartitionProblem) -> Partition | None:
    """Reference solver: every partition into ``stages`` non-empty ranges at allowed cuts (exponential; tests only)."""
    n, S = pb.n, pb.stages
    cuts = [k for k in range(1, n) if pb.allowed[k]]
    best: Partition | None = None
    for inner in itertools.combinations(cuts, S - 1):
        bounds = (0,) + inner + (n,)
        part, over = evaluate(pb, bounds)
        if over:
            continue
        if best is None or part.bottleneck < best.bottleneck:
            best = part
    return best


def lower_bound(total: float, largest: float, stages: int) -> float:
    """max(total / p, largest piece): no partition of the pieces into ``stages`` ranges has a smaller bottleneck."""
    return max(total / stages, largest)
