"""One event-driven simulator for any pipeline :class:`~planner.solve.schedules.Schedule`.

Model
-----
- Each rank has one compute stream and runs its action list in order, never
  reordering. An action starts when its rank is free and its dependencies are
  met, and runs for its stage's time:

  ==========  =====================================================================  ===========================
  action      waits for                                                              duration (s)
  ==========  =====================================================================  ===========================
  F(s, j)     F(s-1, j) done, plus ``send_fwd[s-1]`` if stage s-1 is on another rank  ``fwd[s]``
  B/I(s, j)   F(s, j) done, and B/I(s+1, j) done plus ``send_bwd[s]`` if stage s+1 is  ``bwd_input[s] + bwd_weight[s]``
              on another rank (the last stage needs only its own F)                   for B, ``bwd_input[s]`` for I
  W(s, j)     I(s, j) done                                                           ``bwd_weight[s]``
  ==========  =====================================================================  ===========================

- Sends never occupy the compute stream (they overlap compute) but delay their
  consumer; transfers between stages on the same rank are free. Link
  contention is not modelled.
- Memory: a microbatch's activations on stage s (``StageMemory.activation[s]``
  bytes) are held from the start of its F until the end of its B (or I); with a
  split backward, ``wgrad_pending[s]`` bytes (what W still reads) are held from
  the end of I to the end of W. Because a rank's actions never overlap in time,
  these peaks depend only on the action order, not on the times.

The step starts at time 0 with an empty pipeline; ``step_time`` is the end of
the last action. Times are in seconds, memory in bytes. The simulator is
torch-free and fast: the schedule is compiled once (cached on the schedule
object) and each call is one pass over the actions (about a microsecond each).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from planner.solve.schedules import Action, Schedule, validate_schedule

__all__ = ["StageTimes", "StageMemory", "SimResult", "simulate", "critical_path"]

_F, _B, _I, _W = 0, 1, 2, 3
_KIND_CODE = {"F": _F, "B": _B, "I": _I, "W": _W}


def _floats(name: str, seq: Sequence[float], n: int) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in seq)
    except TypeError as exc:
        raise ValueError(f"{name} must be a sequence of numbers") from exc
    if len(vals) != n:
        raise ValueError(f"{name} has {len(vals)} entries, expected {n}")
    for i, x in enumerate(vals):
        if not math.isfinite(x) or x < 0:
            raise ValueError(f"{name}[{i}] = {x!r} must be finite and >= 0")
    return vals


@dataclass(frozen=True)
class StageTimes:
    """Per-stage times of one microbatch, in seconds (index = global stage).

    Attributes:
        fwd: forward time of each stage.
        bwd_input: backward-input (I) time of each stage. A full backward ``B``
            takes ``bwd_input + bwd_weight``.
        bwd_weight: backward-weight (W) time of each stage.
        send_fwd: ``send_fwd[s]`` is the time to send stage s's output to stage
            s+1 (``num_stages - 1`` entries). Ignored (0) when both stages share a rank.
        send_bwd: ``send_bwd[s]`` is the time to send the gradient from stage s+1
            back to stage s (``num_stages - 1`` entries). Ignored on the same rank.
    """

    fwd: Sequence[float]
    bwd_input: Sequence[float]
    bwd_weight: Sequence[float]
    send_fwd: Sequence[float] = ()
    send_bwd: Sequence[float] = ()

    def __post_init__(self) -> None:
        n = len(self.fwd)
        if n < 1:
            raise ValueError("StageTimes needs at least one stage")
        object.__setattr__(self, "fwd", _floats("fwd", self.fwd, n))
        object.__setattr__(self, "bwd_input", _floats("bwd_input", self.bwd_input, n))
        object.__setattr__(self, "bwd_weight", _floats("bwd_weight", self.bwd_weight, n))
        for name in ("send_fwd", "send_bwd"):
            val = getattr(self, name)
            if len(val) == 0 and n > 1:
                val = (0.0,) * (n - 1)
            object.__setattr__(self, name, _floats(name, val, n - 1))

    @property
    def num_stages(self) -> int:
        return len(self.fwd)

    def blocking(self) -> StageTimes:
        """These times when each send holds its sender until it completes (an engine that waits on its sends before
        the next pass) and the receiver has the data then: stage s's forward takes ``send_fwd[s]`` longer, its
        input-gradient pass ``send_bwd[s - 1]`` longer, and no link delays a receiver. For stages on ranks of their
        own (one stage per rank); the sends' two ends meet as a paired blocking exchange would have them meet."""
        n = self.num_stages
        sf, sb = self.send_fwd, self.send_bwd
        return StageTimes(
            tuple(self.fwd[s] + (sf[s] if s < n - 1 else 0.0) for s in range(n)),
            tuple(self.bwd_input[s] + (sb[s - 1] if s > 0 else 0.0) for s in range(n)),
            self.bwd_weight,
        )

    @classmethod
    def uniform(
        cls,
        num_stages: int,
        fwd: float,
        bwd_input: float,
        bwd_weight: float = 0.0,
        send: float = 0.0,
    ) -> StageTimes:
        """Identical stages: ``fwd``, ``bwd_input``, ``bwd_weight`` and ``send`` seconds each."""
        return cls(
            fwd=(fwd,) * num_stages,
            bwd_input=(bwd_input,) * num_stages,
            bwd_weight=(bwd_weight,) * num_stages,
            send_fwd=(send,) * (num_stages - 1),
            send_bwd=(send,) * (num_stages - 1),
        )


@dataclass(frozen=True)
class StageMemory:
    """Per-stage memory of one microbatch in flight, in bytes (index = global stage).

    Attributes:
        activation: bytes held from the start of F(s, j) until the end of B(s, j)
            or I(s, j): the saved activations (and stage input) of one microbatch.
        wgrad_pending: bytes held from the end of I(s, j) until the end of
            W(s, j): what the deferred weight-gradient pass still reads (layer
            inputs and output gradients). Unused by schedules without I/W split.
    """

    activation: Sequence[float]
    wgrad_pending: Sequence[float] = ()

    def __post_init__(self) -> None:
        n = len(self.activation)
        object.__setattr__(self, "activation", _floats("activation", self.activation, n))
        wg = self.wgrad_pending if len(self.wgrad_pending) else (0.0,) * n
        object.__setattr__(self, "wgrad_pending", _floats("wgrad_pending", wg, n))


@dataclass
class SimResult:
    """What one simulated step costs.

    Attributes:
        step_time: makespan of the step, seconds (end of the last action; the
            step starts at 0 with an empty pipeline).
        busy: per rank, seconds of compute.
        bubble_fraction: ``1 - sum(busy) / (p * step_time)``, the idle share of
            all ranks' time.
        peak_inflight: per rank, the most microbatch activations held at once
            (over all its stages; F start to B/I end).
        peak_inflight_by_stage: per stage, the most microbatches of that stage
            whose activations are held at once.
        peak_bytes: per rank, peak of held activation + pending weight-gradient
            bytes, when a :class:`StageMemory` is given; else None.
        timeline: ``(rank, action, start, end)`` sorted by (rank, start); empty
            when ``simulate(..., timeline=False)``.
        peak_pending_w: per rank, the most microbatches waiting for their W pass
            at once (I done, W not yet done); zeros without I/W split.
        steady_state_step_time: for schedules without a flush (PipeDream), the
            time per ``m`` microbatches once the pipeline is full: the busiest
            rank's compute. None for flushing schedules.
    """

    step_time: float
    busy: list[float]
    bubble_fraction: float
    peak_inflight: list[int]
    peak_inflight_by_stage: list[int]
    peak_bytes: list[float] | None
    timeline: list[tuple[int, Action, float, float]] = field(default_factory=list)
    peak_pending_w: list[int] = field(default_factory=list)
    steady_state_step_time: float | None = None

    @property
    def idle(self) -> list[float]:
        """Per rank idle seconds within the step (``step_time - busy``)."""
        return [self.step_time - b for b in self.busy]


# ------------------------------------------------------------------ compilation


@dataclass
class _Compiled:
    codes: list[list[tuple[int, int, int]]]  # per rank: (kind code, stage, key = stage*m + mb)
    cross_f: list[bool]  # cross_f[s]: stage s-1 is on another rank (s >= 1)
    cross_b: list[bool]  # cross_b[s]: stage s+1 is on another rank (s <= S-2)
    counts: list[list[tuple[int, int, int]]]  # per rank: (kind code, stage, count)
    peak_inflight: list[int]
    peak_by_stage: list[int]
    peak_pending_w: list[int]


def _compile(schedule: Schedule) -> _Compiled:
    comp = schedule._compiled
    if isinstance(comp, _Compiled):
        return comp
    problems = validate_schedule(schedule)
    if problems:
        raise ValueError(f"malformed schedule {schedule.name!r}: " + "; ".join(problems[:5]))
    S, m = schedule.num_stages, schedule.num_microbatches
    s2r = schedule.stage_to_rank
    codes = []
    counts = []
    peak_rank = []
    peak_stage = [0] * S
    cur_stage = [0] * S
    peak_w = []
    for acts in schedule.actions:
        rc = []
        cnt: dict[tuple[int, int], int] = {}
        cur = peak = 0
        wcur = wpeak = 0
        for a in acts:
            k = _KIND_CODE[a.kind]
            s = a.stage
            rc.append((k, s, s * m + a.microbatch))
            cnt[(k, s)] = cnt.get((k, s), 0) + 1
            if k == _F:
                cur += 1
                cur_stage[s] += 1
                if cur > peak:
                    peak = cur
                if cur_stage[s] > peak_stage[s]:
                    peak_stage[s] = cur_stage[s]
            elif k == _W:
                wcur -= 1
            else:
                cur -= 1
                cur_stage[s] -= 1
                if k == _I:
                    wcur += 1
                    if wcur > wpeak:
                        wpeak = wcur
        codes.append(rc)
        counts.append([(k, s, c) for (k, s), c in cnt.items()])
        peak_rank.append(peak)
        peak_w.append(wpeak)
    comp = _Compiled(
        codes=codes,
        cross_f=[s > 0 and s2r[s - 1] != s2r[s] for s in range(S)],
        cross_b=[s < S - 1 and s2r[s + 1] != s2r[s] for s in range(S)],
        counts=counts,
        peak_inflight=peak_rank,
        peak_by_stage=peak_stage,
        peak_pending_w=peak_w,
    )
    object.__setattr__(schedule, "_compiled", comp)
    return comp


# -------------------------------------------------------------------- simulation


def simulate(
    schedule: Schedule,
    times: StageTimes,
    memory: StageMemory | None = None,
    *,
    timeline: bool = True,
) -> SimResult:
    """Simulate one training step of ``schedule`` with per-stage ``times``.

    Args:
        schedule: the schedule (per-rank action lists).
        times: per-stage times in seconds; lengths must match ``schedule.num_stages``.
        memory: optional per-stage bytes, for ``peak_bytes``.
        timeline: False skips building the timeline (faster; for the search).

    Returns:
        A :class:`SimResult`.

    Raises:
        ValueError: when the schedule is malformed, the times or memory do not
            match its stages, or the ranks deadlock (the message names the stuck
            rank, its action and what it waits for).
    """
    comp = _compile(schedule)
    S, m, p = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    if times.num_stages != S:
        raise ValueError(f"times describe {times.num_stages} stages, schedule {schedule.name!r} has {S}")
    fdur = times.fwd
    idur = times.bwd_input
    wdur = times.bwd_weight
    bdur = [a + b for a, b in zip(idur, wdur)]
    sf, sb = times.send_fwd, times.send_bwd
    fdelay = [sf[s - 1] if comp.cross_f[s] else 0.0 for s in range(S)]
    bdelay = [sb[s] if comp.cross_b[s] else 0.0 for s in range(S)]
    ibdur = (fdur, bdur, idur)  # duration table by kind code for B and I (index 0, F, unused here)

    SM = S * m
    done: list[float | None] = [None] * (2 * SM)  # [0, SM): F end; [SM, 2SM): B/I end
    waiter = [-1] * (2 * SM)  # rank blocked on this key, if any
    codes = comp.codes
    ptr = [0] * p
    free = [0.0] * p
    starts: list[list[float]] | None = [[] for _ in range(p)] if timeline else None
    last = S - 1
    stack = list(range(p - 1, -1, -1))
    while stack:
        r = stack.pop()
        acts = codes[r]
        n = len(acts)
        i = ptr[r]
        t = free[r]
        rec = starts[r].append if starts is not None else None
        while i < n:
            kind, s, key = acts[i]
            if kind == _F:
                st = t
                if s:
                    d = done[key - m]
                    if d is None:
                        waiter[key - m] = r
                        break
                    d += fdelay[s]
                    if d > st:
                        st = d
                t = st + fdur[s]
                done[key] = t
                w = waiter[key]
            elif kind == _W:
                d = done[SM + key]
                if d is None:
                    waiter[SM + key] = r
                    break
                st = d if d > t else t
                t = st + wdur[s]
                w = -1
            else:  # B or I
                d = done[key]
                if d is None:
                    waiter[key] = r
                    break
                st = d if d > t else t
                if s != last:
                    d = done[SM + key + m]
                    if d is None:
                        waiter[SM + key + m] = r
                        break
                    d += bdelay[s]
                    if d > st:
                        st = d
                t = st + ibdur[kind][s]
                key += SM
                done[key] = t
                w = waiter[key]
            if w >= 0:
                waiter[key] = -1
                stack.append(w)
            if rec is not None:
                rec(st)
            i += 1
        ptr[r] = i
        free[r] = t

    stuck = [r for r in range(p) if ptr[r] < len(codes[r])]
    if stuck:
        raise ValueError(_deadlock_message(schedule, comp, ptr, stuck, done))

    step = max(free) if p else 0.0
    durs = (fdur, bdur, idur, wdur)
    busy = [sum(durs[k][s] * c for k, s, c in cnt) for cnt in comp.counts]
    # clamp float round-off (busy is summed per stage, step action by action)
    bubble = max(0.0, 1.0 - sum(busy) / (p * step)) if step > 0 else 0.0

    peak_bytes = None
    if memory is not None:
        peak_bytes = _peak_bytes(comp, memory, S)

    tl: list[tuple[int, Action, float, float]] = []
    if starts is not None:
        for r, rank_acts in enumerate(schedule.actions):
            st_r = starts[r]
            for a, st in zip(rank_acts, st_r):
                k = _KIND_CODE[a.kind]
                tl.append((r, a, st, st + durs[k][a.stage]))

    return SimResult(
        step_time=step,
        busy=busy,
        bubble_fraction=bubble,
        peak_inflight=list(comp.peak_inflight),
        peak_inflight_by_stage=list(comp.peak_by_stage),
        peak_bytes=peak_bytes,
        timeline=tl,
        peak_pending_w=list(comp.peak_pending_w),
        steady_state_step_time=None if schedule.flush else max(busy),
    )


def _peak_bytes(comp: _Compiled, memory: StageMemory, S: int) -> list[float]:
    act = memory.activation
    wg = memory.wgrad_pending
    if len(act) != S:
        raise ValueError(f"memory describes {len(act)} stages, schedule has {S}")
    out = []
    for rc in comp.codes:
        cur = peak = 0.0
        for k, s, _ in rc:
            if k == _F:
                cur += act[s]
            elif k == _B:
                cur -= act[s]
            elif k == _I:
                cur += wg[s] - act[s]
            else:
                cur -= wg[s]
            if cur > peak:
                peak = cur
        out.append(peak)
    return out


def _deadlock_message(schedule: Schedule, comp: _Compiled, ptr: list[int], stuck: list[int], done: Sequence[float | None]) -> str:
    m = schedule.num_microbatches

    def blocked_on(r: int) -> str:
        a = schedule.actions[r][ptr[r]]
        s, j = a.stage, a.microbatch
        if a.kind == "F":
            need = Action("F", s - 1, j)
        elif a.kind == "W":
            need = Action("I", s, j)
        elif done[s * m + j] is None:
            need = Action("F", s, j)
        else:
            need = Action("B/I", s + 1, j)  # type: ignore[arg-type,unused-ignore]
        owner = schedule.stage_to_rank[need.stage]
        state = (
            "later in its own list"
            if owner == r
            else (
                f"rank {owner} is stuck at action #{ptr[owner]} {schedule.actions[owner][ptr[owner]]}"
                if ptr[owner] < len(schedule.actions[owner])
                else f"rank {owner} never runs it"
            )
        )
        return (
            f"rank {r} is stuck at action #{ptr[r]} {a.kind}(stage={s}, mb={j}), waiting for {need.kind}(stage={need.stage}, mb={j}) on rank {owner} ({state})"
        )

    lines = [blocked_on(r) for r in stuck[:4]]
    more = f" (and {len(stuck) - 4} more ranks)" if len(stuck) > 4 else ""
    return f"schedule {schedule.name!r} deadlocks: " + "; ".join(lines) + more


def critical_path(times: StageTimes, stage_to_rank: Sequence[int] | None = None) -> float:
    """Lower bound on any step: one microbatch's forward through every stage,
    input-gradient backward through every stage, sends between ranks, and the
    smallest weight-gradient pass (seconds).
    """
    S = times.num_stages
    sends = 0.0
    for s in range(S - 1):
        if stage_to_rank is None or stage_to_rank[s] != stage_to_rank[s + 1]:
            sends += times.send_fwd[s] + times.send_bwd[s]
    return sum(times.fwd) + sum(times.bwd_input) + min(times.bwd_weight) + sends
