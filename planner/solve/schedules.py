"""Pipeline schedules as data: per rank, the ordered compute actions.

A :class:`Schedule` lists, for every pipeline rank, the forward and backward
passes it runs in one training step, in the order it runs them. It says
nothing about time: :mod:`planner.solve.simulate` turns a schedule plus
per-stage costs into a step time, a bubble and peak memory, and the same IR
drives the timeline picture and the comparison with
``torch.distributed.pipelining``'s own ``pipeline_order``.

Vocabulary
----------
- ``p`` pipeline ranks, ``v`` model chunks (stages) per rank, ``num_stages = p * v``
  global stages numbered in model order, ``m`` microbatches per step.
- Action kinds (the same letters torch uses): ``F`` forward, ``B`` full backward
  (input and weight gradients), ``I`` backward for the input gradient only,
  ``W`` backward for the weight gradient only. For one ``(stage, microbatch)`` a
  schedule runs either ``B``, or ``I`` and later ``W``.
- Placement: ``loop`` puts stage ``s`` on rank ``s % p`` (interleaved and looped
  schedules, Megatron's virtual pipeline); ``v`` (V-shape) puts stages ``r`` and
  ``2p-1-r`` on rank ``r`` (ZB-V, DualPipeV).

Schedules (see :data:`SCHEDULES`)
---------------------------------
Every generator is written here from the published algorithm; where an engine
runs the schedule, the order is the engine's own (tests compare it with
torch 2.13's ``pipeline_order`` action for action):

- ``gpipe``: all forwards, then all backwards in increasing microbatch order
  (torch ``ScheduleGPipe``'s order).
- ``1f1b``: PipeDream-Flush. Rank ``r`` runs ``min(p-r-1, m)`` warm-up
  forwards, then alternates one forward and one backward, then drains the
  remaining backwards. DeepSpeed's ``TrainSchedule`` (forward of microbatch j at
  step ``2j+s``, backward at ``2j+2p-s-1``), Megatron's
  ``forward_backward_pipelining_without_interleaving`` and torch's
  ``Schedule1F1B`` all produce exactly this order.
- ``interleaved``: Megatron's interleaved 1F1B (depth first), ``v >= 2`` chunks
  per rank. Microbatches are taken in groups of ``g`` per chunk:
  ``g = m // max(1, m // p)`` (torch's "flexible" rounds; equal to ``p`` when
  ``m % p == 0``, Megatron's default group size). Rank ``r`` warms up with
  ``min((v-1)*g + 2*(p-1-r), v*m)`` forwards. Identical to torch's
  ``ScheduleInterleaved1F1B``, and to Megatron's order whenever Megatron accepts
  the configuration (``m % p == 0``, ``m >= p``, default group size). An
  explicit group size ``g`` (Megatron's ``microbatch_group_size_per_vp_stage``)
  takes the microbatches ``g`` at a time, the last group holding what is left,
  and warms up with ``(v-1)*g + 2*(p-1-r)`` forwards: Megatron's order for every
  ``g`` it accepts (``p <= g <= m``, ``m % g`` zero or at least ``p``).
- ``looped-bfs``: breadth first (Lamy-Poirier 2022): each local stage runs all
  its forwards, then backwards in reverse stage and microbatch order (torch
  ``ScheduleLoopedBFS``).
- ``zb-h1``: ZB-H1 of Qi et al. 2023 (arXiv 2401.10241): 1F1B with the backward
  split into ``I`` and ``W``; rank ``r`` holds back its first ``r`` ``W`` passes and
  runs them in the cool-down bubbles. Same activation peak as 1F1B. Equal to
  torch's ``ScheduleInterleavedZeroBubble`` with one stage per rank.
- ``interleaved-zb``: the same with ``v >= 2`` chunks (torch's
  ``ScheduleInterleavedZeroBubble``, the paper's ZB1P).
- ``zbv``: ZB-V (paper section 6), two chunks per rank in V placement, torch's
  ``ScheduleZBVZeroBubble``.
- ``dualpipev``: DeepSeek's DualPipeV as torch's ``ScheduleDualPipeV`` builds it;
  torch's overlapped ``OVERLAP_F_B`` pairs become a forward followed by a
  backward (their compute is sequential on one device; what DualPipe overlaps
  is communication).
- ``pipedream`` and ``pipedream-2bw``: analysis only (no target engine runs
  them). Asynchronous 1F1B without a flush: the per-rank order of one window of
  ``m`` microbatches is the 1F1B order, and the schedule carries how many weight
  versions each stage stashes (:meth:`Schedule.weight_versions`).

This module is torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache

from planner.errors import did_you_mean

__all__ = [
    "Action",
    "Schedule",
    "ScheduleInfo",
    "SCHEDULES",
    "SCHEDULE_INFO",
    "ANALYSIS_ONLY",
    "KINDS",
    "build_schedule",
    "schedule_constraints",
    "validate_schedule",
    "to_torch_order",
    "interleaved_group_size",
    "normalised_group",
    "group_constraints",
    "iter_actions",
]

KINDS = ("F", "B", "I", "W")
"""Action kinds: forward, full backward, backward-input, backward-weight."""


@dataclass(frozen=True, slots=True)
class Action:
    """One compute pass of one microbatch through one stage.

    Attributes:
        kind: ``"F"`` forward, ``"B"`` full backward (input + weight gradients),
            ``"I"`` backward-input only, ``"W"`` backward-weight only.
        stage: global stage index, ``0 .. num_stages-1`` in model order.
        microbatch: microbatch index, ``0 .. m-1``.
    """

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        # torch.distributed.pipelining's spelling: stage, kind, microbatch ("3F0").
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: per rank, the ordered compute actions of one step.

    Attributes:
        name: schedule name, a key of :data:`SCHEDULES`.
        num_ranks: ``p``, pipeline ranks.
        num_stages: ``p * v`` global stages.
        num_microbatches: ``m``, microbatches per step.
        stage_to_rank: rank of each global stage.
        actions: per rank, the actions in execution order.
        analysis_only: True for schedules no target engine runs (PipeDream).
        flush: False for asynchronous schedules (PipeDream) whose pipeline never
            drains: ``actions`` then describe one window of ``m`` microbatches
            starting from an empty pipeline.
        weight_versions_per_stage: weight versions each stage keeps (1 for
            synchronous schedules; PipeDream stashes more).
    """

    name: str
    num_ranks: int
    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    analysis_only: bool = False
    flush: bool = True
    weight_versions_per_stage: tuple[int, ...] = ()
    #: microbatches per chunk group of the interleaved schedule when set explicitly (0: the default,
    #: :func:`interleaved_group_size`)
    group: int = 0
    # Simulator's compiled form, filled lazily by planner.solve.simulate.
    _compiled: object = field(default=None, init=False, repr=False, compare=False, hash=False)

    @property
    def v(self) -> int:
        """Stages (model chunks) per rank."""
        return self.num_stages // self.num_ranks

    def rank_of(self, stage: int) -> int:
        """Rank that runs global stage ``stage``."""
        return self.stage_to_rank[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Global stages on ``rank``, in model order."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def weight_versions(self, stage: int) -> int:
        """Number of weight versions stage ``stage`` keeps at once (1 unless PipeDream)."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} out of range 0..{self.num_stages - 1}")
        if self.weight_versions_per_stage:
            return self.weight_versions_per_stage[stage]
        return 1

    @property
    def num_actions(self) -> int:
        """Total number of compute actions over all ranks."""
        return sum(len(a) for a in self.actions)

    def uses_split_backward(self) -> bool:
        """True if any backward is split into I and W passes."""
        return any(a.kind == "I" for acts in self.actions for a in acts)


@dataclass(frozen=True)
class ScheduleInfo:
    """What a schedule is and who runs it.

    Attributes:
        description: one line for humans.
        torch_class: the ``torch.distributed.pipelining.schedules`` class whose
            order this schedule reproduces, or None.
        analysis_only: True if no target engine runs it.
        placement: ``"loop"`` (stage s on rank s % p) or ``"v"`` (V-shape).
        split_backward: True if the backward is split into I and W passes.
    """

    description: str
    torch_class: str | None
    analysis_only: bool = False
    placement: str = "loop"
    split_backward: bool = False


SCHEDULE_INFO: dict[str, ScheduleInfo] = {
    "gpipe": ScheduleInfo(
        "GPipe: all forwards, then all backwards (fill-drain); holds m microbatches of activations. torch ScheduleGPipe.",
        "ScheduleGPipe",
    ),
    "1f1b": ScheduleInfo(
        "1F1B / PipeDream-Flush: warm-up forwards then one forward one backward; stage i holds min(m, p-i) microbatches. "
        "DeepSpeed TrainSchedule, Megatron without interleaving, torch Schedule1F1B.",
        "Schedule1F1B",
    ),
    "interleaved": ScheduleInfo(
        "Interleaved 1F1B (virtual pipeline, v chunks per rank, stage s on rank s % p): bubble / v, v x more P2P. "
        "Megatron --num-virtual-stages-per-pipeline-rank, torch ScheduleInterleaved1F1B.",
        "ScheduleInterleaved1F1B",
    ),
    "looped-bfs": ScheduleInfo(
        "Breadth-first looped schedule: each local stage runs all its forwards, backwards in reverse. torch ScheduleLoopedBFS.",
        "ScheduleLoopedBFS",
    ),
    "zb-h1": ScheduleInfo(
        "ZB-H1 zero bubble (Qi et al. 2023): 1F1B with backward split into I and W, W deferred into the bubbles; "
        "1F1B's activation peak. torch ScheduleInterleavedZeroBubble with one stage per rank.",
        "ScheduleInterleavedZeroBubble",
        split_backward=True,
    ),
    "interleaved-zb": ScheduleInfo(
        "Interleaved zero bubble (ZB1P, v >= 2 chunks per rank, looped placement). torch ScheduleInterleavedZeroBubble.",
        "ScheduleInterleavedZeroBubble",
        split_backward=True,
    ),
    "zbv": ScheduleInfo(
        "ZB-V zero bubble: 2 chunks per rank in V placement, I/W split; near-zero bubble when F = B = W. torch ScheduleZBVZeroBubble.",
        "ScheduleZBVZeroBubble",
        placement="v",
        split_backward=True,
    ),
    "dualpipev": ScheduleInfo(
        "DualPipeV (DeepSeek): V placement, overlapped forward/backward pairs (modelled as F then B), needs m >= 2p. torch ScheduleDualPipeV.",
        "ScheduleDualPipeV",
        placement="v",
        split_backward=True,
    ),
    "pipedream": ScheduleInfo(
        "PipeDream (asynchronous 1F1B with weight stashing, no flush): stage i keeps p-i weight versions. Analysis only.",
        None,
        analysis_only=True,
    ),
    "pipedream-2bw": ScheduleInfo(
        "PipeDream-2BW (asynchronous 1F1B, double-buffered weights, update every m >= p microbatches): 2 weight versions per stage. Analysis only.",
        None,
        analysis_only=True,
    ),
}

SCHEDULES: dict[str, str] = {name: info.description for name, info in SCHEDULE_INFO.items()}
"""Schedule name -> short description (what runs it; analysis-only ones say so)."""

ANALYSIS_ONLY: frozenset[str] = frozenset(n for n, i in SCHEDULE_INFO.items() if i.analysis_only)
"""Schedules no target engine runs (priced for comparison, never rendered)."""


# --------------------------------------------------------------------------- rules


def interleaved_group_size(p: int, m: int) -> int:
    """Microbatches per chunk group of the interleaved schedules.

    ``m // max(1, m // p)``: torch's "rounds" (``max(1, m // p)`` of them), which is
    ``p`` when ``m`` is a multiple of ``p`` (Megatron's default
    ``microbatch_group_size_per_vp_stage``) and ``m`` when ``m < p``.
    """
    return m // max(1, m // p)


def normalised_group(name: str, p: int, m: int, group: int) -> int:
    """``group`` with the default written as 0: a pinned ``interleaved`` group equal to the one the
    schedule takes by itself (:func:`interleaved_group_size`, when the rounds tile ``m``) builds the
    default schedule, so layouts, plans and rendered scripts that differ only in spelling it compare equal."""
    if group and name == "interleaved" and m % max(1, m // p) == 0 and group == interleaved_group_size(p, m):
        return 0
    return group


def _as_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def schedule_constraints(name: str, p: int, m: int, v: int = 1, group: int = 0) -> list[str]:
    """The rules that ``(name, p, m, v, group)`` violates; empty when the schedule can be built.

    These are the schedule's own rules; each engine adds its run-time rules
    (planner.engines.<name>.schedule_problems).

    Args:
        name: schedule name (a key of :data:`SCHEDULES`).
        p: pipeline ranks.
        m: microbatches per step.
        v: stages (model chunks) per rank.
        group: microbatches per chunk group of ``interleaved`` (0: the default,
            :func:`interleaved_group_size`). Allowed: the groups Megatron accepts
            (``p <= g <= m`` with the last group, ``m % g`` microbatches, empty or at
            least ``p``) and one group of all ``m``. Every such order runs without
            deadlock (tests/solve/test_schedules.py simulates each one up to p = 6,
            m = 16); smaller groups deadlock depth-first interleaving in many cases
            (p = 16, m = 32, v = 8, g = 4: rank 0 waits on a chunk-1 forward that
            rank 15 holds back behind a backward that cannot come).
    Returns:
        Human-readable rule violations, each stating the rule.
    """
    out: list[str] = []
    if name not in SCHEDULE_INFO:
        return [f"unknown schedule {name!r}; known: {', '.join(SCHEDULE_INFO)}.{did_you_mean(name, SCHEDULE_INFO)}"]
    for label, val in (("p (pipeline ranks)", p), ("m (microbatches)", m), ("v (stages per rank)", v)):
        if not _as_int(val) or val < 1:
            out.append(f"{label} must be an integer >= 1, got {val!r}")
    if out:
        return out

    if group:
        out += group_constraints(name, p, m, group)
    rounds = max(1, m // p)
    if name in ("gpipe", "1f1b", "zb-h1", "pipedream", "pipedream-2bw"):
        if v != 1:
            out.append(f"{name} runs one stage per rank: v must be 1, got v={v}")
    elif name in ("interleaved", "interleaved-zb"):
        if v < 2:
            alt = "1f1b" if name == "interleaved" else "zb-h1"
            out.append(f"{name} needs v >= 2 stages per rank (got v={v}); use {alt!r} for v=1")
        if m % rounds != 0 and not group:
            out.append(
                f"{name} needs m to be a multiple of its number of rounds max(1, m // p) = {rounds} (got m={m}, p={p}); e.g. m < {2 * p} or m a multiple of p"
            )
    elif name in ("zbv", "dualpipev"):
        if v != 2:
            out.append(f"{name} places exactly 2 stages per rank in a V: v must be 2, got v={v}")
        if name == "dualpipev" and m < 2 * p:
            out.append(f"dualpipev needs m >= 2p = number of stages ({2 * p}), got m={m}")
    # looped-bfs: any v >= 1, any m.
    if name == "pipedream-2bw" and m < p:
        out.append(f"pipedream-2bw needs m >= p ({p}) microbatches per weight update so that 2 weight versions suffice, got m={m}")

    return out


def group_constraints(name: str, p: int, m: int, group: int) -> list[str]:
    """The rules an explicit interleaved group size ``group`` violates (see :func:`schedule_constraints`)."""
    if name != "interleaved":
        return [f"only the interleaved schedule takes a micro-batch group size (got {name!r} with group {group})"]
    if not _as_int(group) or group < 1:
        return [f"the micro-batch group size must be an integer >= 1, got {group!r}"]
    if group > m:
        return [f"the micro-batch group size ({group}) exceeds the micro-batches per step (m={m})"]
    last = m % group
    if group == m or (group >= p and (last == 0 or last >= p)):
        return []
    if group < p:
        return [
            f"a micro-batch group of {group} < p ({p}) can deadlock depth-first interleaving (Megatron refuses it): use a group of at least {p}, or {m} (all)"
        ]
    return [
        f"the last micro-batch group would hold m % group = {last} < p ({p}) micro-batches, which Megatron refuses (dependency bubbles): "
        f"pick a group that divides m={m} or leaves at least {p}"
    ]


# ----------------------------------------------------------------------- generators

RankOps = list[tuple[str, int, int]]  # (kind, stage, microbatch)


def _gen_gpipe(p: int, m: int, v: int) -> list[RankOps]:
    return [[("F", r, j) for j in range(m)] + [("B", r, j) for j in range(m)] for r in range(p)]


def _gen_1f1b(p: int, m: int, v: int) -> list[RankOps]:
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        ops: RankOps = [("F", r, j) for j in range(warm)]
        for j in range(m - warm):  # steady state: forward of warm+j, backward of j
            ops.append(("F", r, warm + j))
            ops.append(("B", r, j))
        ops.extend(("B", r, j) for j in range(m - warm, m))
        out.append(ops)
    return out


def _group_table(m: int, v: int, g: int) -> tuple[tuple[int, int], ...]:
    """(chunk, microbatch) of each virtual microbatch of depth-first interleaving with groups of ``g``.

    ``g`` microbatches of chunk 0, then the same ``g`` of chunk 1, ..., chunk v-1, then
    the next ``g``; the last group holds what is left (``m % g`` when ``g`` does not
    divide ``m``). This is Megatron's ``get_schedule_table``.
    """
    return tuple((c, j) for lo in range(0, m, g) for c in range(v) for j in range(lo, min(lo + g, m)))


def _chunk_order(p: int, r: int, v: int, table: tuple[tuple[int, int], ...], k: int, backward: bool) -> tuple[int, int]:
    """(stage, microbatch) of rank r's k-th forward (or backward) in depth-first interleaving.

    Backwards visit the chunks of each group in reverse (chunk v-1 first).
    """
    chunk, mb = table[k]
    if backward:
        chunk = v - 1 - chunk
    return chunk * p + r, mb


def _gen_interleaved(p: int, m: int, v: int, group: int = 0) -> list[RankOps]:
    g = group or interleaved_group_size(p, m)
    table = _group_table(m, v, g)
    total = v * m
    out = []
    for r in range(p):
        warm = min((v - 1) * g + 2 * (p - 1 - r), total)
        ops: RankOps = []
        for k in range(warm):
            ops.append(("F",) + _chunk_order(p, r, v, table, k, False))
        for k in range(total - warm):
            ops.append(("F",) + _chunk_order(p, r, v, table, warm + k, False))
            ops.append(("B",) + _chunk_order(p, r, v, table, k, True))
        for k in range(total - warm, total):
            ops.append(("B",) + _chunk_order(p, r, v, table, k, True))
        out.append(ops)
    return out


def _gen_zero_bubble(p: int, m: int, v: int) -> list[RankOps]:
    """ZB-H1 (v=1) / ZB1P (v>=2): interleaved 1F1B with I/W split.

    Warm-up is ``min((v-1)*g + (p-1-r), v*m)`` forwards (one fewer per hop than
    interleaved 1F1B, as ZB-H1 runs I in B's slot). Rank r then pairs each
    forward with an I and, from its (r+1)-th I on, appends the oldest pending W;
    the first r W passes are left for the end, where they fill the cool-down.
    """
    g = interleaved_group_size(p, m)
    table = _group_table(m, v, g)
    total = v * m
    out = []
    for r in range(p):
        warm = min((v - 1) * g + (p - 1 - r), total)
        ops: RankOps = []
        pending: list[tuple[int, int]] = []  # I done, W not yet issued (FIFO)
        for k in range(warm):
            ops.append(("F",) + _chunk_order(p, r, v, table, k, False))
        for k in range(total):
            if k < total - warm:
                ops.append(("F",) + _chunk_order(p, r, v, table, warm + k, False))
            sm = _chunk_order(p, r, v, table, k, True)
            ops.append(("I",) + sm)
            pending.append(sm)
            if k >= r:
                ops.append(("W",) + pending.pop(0))
        ops.extend(("W",) + sm for sm in pending)
        out.append(ops)
    return out


def _gen_looped_bfs(p: int, m: int, v: int) -> list[RankOps]:
    out = []
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        ops: RankOps = [("F", s, j) for s in stages for j in range(m)]
        ops += [("B", s, j) for s in reversed(stages) for j in reversed(range(m))]
        out.append(ops)
    return out


class _Emitter:
    """Appends actions of one rank, numbering microbatches per (stage, kind) in order."""

    def __init__(self) -> None:
        self.ops: RankOps = []
        self.next: dict[tuple[str, int], int] = {}

    def count(self, kind: str, stage: int) -> int:
        return self.next.get((kind, stage), 0)

    def emit(self, kind: str, stage: int) -> int:
        j = self.next.get((kind, stage), 0)
        self.next[(kind, stage)] = j + 1
        self.ops.append((kind, stage, j))
        return j


def _gen_zbv(p: int, m: int, v: int) -> list[RankOps]:
    """ZB-V (Qi et al. 2023, section 6) as torch lays it out.

    Rank r owns chunk 0 = stage r (descending leg of the V) and chunk 1 = stage
    2p-1-r (ascending leg). The pattern is built for n = max(m, 2p-1)
    microbatches, the smallest count that fills the V, and actions of
    microbatches >= m are then dropped.
    """
    n = max(m, 2 * p - 1)
    out = []
    for r in range(p):
        e = _Emitter()
        c0, c1 = r, 2 * p - 1 - r
        # warm-up: fill the descending leg, then interleave the ascending one.
        for _ in range(2 * (p - r) - 1):
            e.emit("F", c0)
        for _ in range(r):
            e.emit("F", c1)
            e.emit("F", c0)
        for _ in range(p - r):
            e.emit("F", c1)
            e.emit("I", c1)
            e.emit("W", c1)
        # steady state: F I W on chunk 0, then F I W on chunk 1.
        while e.count("F", c1) < e.count("F", c0) or e.count("F", c0) < n:
            if e.count("F", c0) < n:
                e.emit("F", c0)
            e.emit("I", c0)
            e.emit("W", c0)
            e.emit("F", c1)
            e.emit("I", c1)
            e.emit("W", c1)
        # cool-down: input grads first, weight grads fill the tail.
        for _ in range(r):
            e.emit("I", c0)
            e.emit("I", c1)
        for _ in range(p - r):
            e.emit("I", c0)
            e.emit("W", c0)
        while e.count("W", c1) < e.count("I", c1):
            e.emit("W", c1)
        while e.count("W", c0) < e.count("I", c0):
            e.emit("W", c0)
        out.append([op for op in e.ops if op[2] < m])
    return out


def _gen_dualpipev(p: int, m: int, v: int) -> list[RankOps]:
    """DualPipeV (DeepSeek) as torch 2.13's ScheduleDualPipeV orders it.

    Phases on rank r with chunk 0 = stage r and chunk 1 = stage 2p-1-r:
    (1) 2(p-r-1) forwards of chunk 0; (2) r+1 pairs F0 F1; (3) p-r-1 times
    I1, a pending W, F1; (4) m-2p+r+1 times [F0 with B1] [F1 with B0] (overlapped
    pairs, here forward then full backward; the last rank runs its first pair
    unoverlapped, same order); (5) p-r-1 times B1, [F1 with B0]; (6) r+1 times
    B1 B0, switching to split I passes half way; (7) p-r-1 times a pending W then
    B0 (or I0); (8) the remaining W passes, oldest first.
    """
    out = []
    for r in range(p):
        e = _Emitter()
        c0, c1 = r, 2 * p - 1 - r
        w_queue: list[tuple[int, int]] = []

        def back(stage: int, split: bool) -> None:
            # Full backward, or input-only backward whose W is queued. Both
            # number microbatches with the I counter.
            j = e.count("I", stage)
            e.next[("I", stage)] = j + 1
            if split:
                e.ops.append(("I", stage, j))
                w_queue.append((stage, j))
            else:
                e.ops.append(("B", stage, j))

        def pending_w() -> None:
            if w_queue:
                s, j = w_queue.pop(0)
                e.ops.append(("W", s, j))

        for _ in range(2 * (p - r - 1)):
            e.emit("F", c0)
        for _ in range(r + 1):
            e.emit("F", c0)
            e.emit("F", c1)
        for _ in range(p - r - 1):
            back(c1, True)
            pending_w()
            e.emit("F", c1)
        for _ in range(m - 2 * p + r + 1):
            e.emit("F", c0)
            back(c1, False)
            e.emit("F", c1)
            back(c0, False)
        for _ in range(p - r - 1):
            back(c1, False)
            e.emit("F", c1)
            back(c0, False)
        split = False
        half = (r + 1) // 2
        for i in range(r + 1):
            if i == half and r % 2 == 1:
                split = True
            back(c1, split)
            if i == half and r % 2 == 0:
                split = True
            back(c0, split)
        for _ in range(p - r - 1):
            pending_w()
            back(c0, split)
        while w_queue:
            pending_w()
        out.append(e.ops)
    return out


_GENERATORS: dict[str, Callable[[int, int, int], list[RankOps]]] = {
    "gpipe": _gen_gpipe,
    "1f1b": _gen_1f1b,
    "interleaved": _gen_interleaved,
    "looped-bfs": _gen_looped_bfs,
    "zb-h1": _gen_zero_bubble,
    "interleaved-zb": _gen_zero_bubble,
    "zbv": _gen_zbv,
    "dualpipev": _gen_dualpipev,
    "pipedream": _gen_1f1b,
    "pipedream-2bw": _gen_1f1b,
}


def _stage_to_rank(placement: str, p: int, v: int) -> tuple[int, ...]:
    if placement == "v":
        # stage r on rank r, stage 2p-1-r on rank r
        return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
    return tuple(s % p for s in range(p * v))


def _weight_versions(name: str, p: int, num_stages: int) -> tuple[int, ...]:
    if name == "pipedream":
        # Weight stashing: stage i has p - i microbatches in flight, each pinned to
        # the version it saw in its forward.
        return tuple(p - s for s in range(num_stages))
    if name == "pipedream-2bw":
        # Double buffering: the version being trained plus the shadow version
        # in-flight microbatches still use (one suffices without pipelining).
        return tuple(2 if p > 1 else 1 for _ in range(num_stages))
    return ()


def build_schedule(name: str, p: int, m: int, v: int = 1, group: int = 0) -> Schedule:
    """Build schedule ``name`` for ``p`` ranks, ``m`` microbatches and ``v`` stages per rank.

    Args:
        name: a key of :data:`SCHEDULES`.
        p, m, v: pipeline ranks, microbatches per step, stages per rank.
        group: microbatches per chunk group of ``interleaved`` (0: the default). A group
            equal to the default builds the default schedule (``group`` 0).

    Raises:
        ValueError: listing every violated rule (see :func:`schedule_constraints`).

    Results are cached: the same arguments return the same immutable object.
    """
    group = normalised_group(name, p, m, group)
    problems = schedule_constraints(name, p, m, v, group)
    if problems:
        where = f"p={p}, m={m}, v={v}" + (f", group={group}" if group else "")
        raise ValueError(f"cannot build schedule {name!r} with {where}: " + "; ".join(problems))
    return _build_cached(name, p, m, v, group)


#: the actions built so far, by (kind, stage, microbatch): an action is an immutable value, and the schedules of one
#: search share most of theirs, so each is made once (a frozen dataclass costs a microsecond to build)
_ACTIONS: dict[tuple[str, int, int], Action] = {}
_ACTIONS_MAX = 1 << 18


def _actions(ops: Iterable[tuple[str, int, int]]) -> tuple[Action, ...]:
    """The :class:`Action` of each (kind, stage, microbatch), in order."""
    if len(_ACTIONS) >= _ACTIONS_MAX:
        _ACTIONS.clear()
    out = []
    for op in ops:
        a = _ACTIONS.get(op)
        if a is None:
            a = _ACTIONS[op] = Action(*op)
        out.append(a)
    return tuple(out)


@lru_cache(maxsize=128)
def _build_cached(name: str, p: int, m: int, v: int, group: int = 0) -> Schedule:
    info = SCHEDULE_INFO[name]
    per_rank = _gen_interleaved(p, m, v, group) if group else _GENERATORS[name](p, m, v)
    actions = tuple(_actions(ops) for ops in per_rank)
    num_stages = p * v
    return Schedule(
        name=name,
        num_ranks=p,
        num_stages=num_stages,
        num_microbatches=m,
        stage_to_rank=_stage_to_rank(info.placement, p, v),
        actions=actions,
        analysis_only=info.analysis_only,
        flush=not info.analysis_only,
        weight_versions_per_stage=_weight_versions(name, p, num_stages),
        group=group,
    )


# ------------------------------------------------------------------------ checking


def validate_schedule(schedule: Schedule) -> list[str]:
    """Structural problems of a schedule (empty when well formed).

    Checks: stage indices and placement are consistent; every action runs on the
    rank that owns its stage; every ``(stage, microbatch)`` has exactly one F and
    either exactly one B, or exactly one I and one W; on each rank the F of a
    ``(stage, microbatch)`` precedes its backward and I precedes W. Whether the
    ranks can make progress together (no cross-rank deadlock) is checked by
    :func:`planner.solve.simulate.simulate`.
    """
    problems: list[str] = []
    p, S, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    if len(schedule.stage_to_rank) != S:
        return [f"stage_to_rank has {len(schedule.stage_to_rank)} entries for {S} stages"]
    if len(schedule.actions) != p:
        return [f"actions has {len(schedule.actions)} ranks, expected {p}"]
    if any(not 0 <= r < p for r in schedule.stage_to_rank):
        return [f"stage_to_rank names a rank outside 0..{p - 1}: {schedule.stage_to_rank}"]
    limit = 20
    s2r = schedule.stage_to_rank
    # count[kind][stage*m + mb]: how many times that action appears (so far).
    count = {k: [0] * (S * m) for k in KINDS}
    for r, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            kind, s, j = a.kind, a.stage, a.microbatch
            bad = None
            if kind not in count:
                bad = f"unknown kind {kind!r} (expected one of {KINDS})"
            elif not (0 <= s < S and 0 <= j < m):
                bad = f"stage or microbatch out of range (stages 0..{S - 1}, microbatches 0..{m - 1})"
            else:
                key = s * m + j
                c = count[kind]
                c[key] += 1
                if s2r[s] != r:
                    bad = f"stage {s} belongs to rank {s2r[s]}"
                elif c[key] > 1:
                    bad = "duplicate action"
                elif kind in "BI" and not count["F"][key]:
                    bad = "backward before its forward on this rank"
                elif kind == "W" and not count["I"][key]:
                    bad = "W before its I on this rank"
            if bad:
                problems.append(f"rank {r} action #{i} {a}: {bad}")
                if len(problems) >= limit:
                    return problems + ["... (more problems not listed)"]
    cf, cb, ci, cw = count["F"], count["B"], count["I"], count["W"]
    for key in range(S * m):
        if cf[key] == 1 and ((cb[key] == 1 and ci[key] == 0 and cw[key] == 0) or (cb[key] == 0 and ci[key] == 1 and cw[key] == 1)):
            continue
        s, j = divmod(key, m)
        has = [k for k in KINDS for _ in range(count[k][key])]
        problems.append(f"stage {s} microbatch {j}: needs one F and one B, or one F, one I and one W; has {has}")
        if len(problems) >= limit:
            return problems + ["... (more problems not listed)"]
    return problems


def to_torch_order(schedule: Schedule) -> dict[int, list[str]]:
    """Per rank, the actions spelled as torch's ``_Action`` strings (``"3F0"``, ``"5I2"``).

    This is torch's "compute_only" format: rows of it are what
    ``_PipelineScheduleRuntime._load_csv`` reads, so a schedule can be handed to
    torch as a CSV.
    """
    return {r: [str(a) for a in acts] for r, acts in enumerate(schedule.actions)}


def iter_actions(schedule: Schedule) -> Iterable[tuple[int, Action]]:
    """All ``(rank, action)`` pairs, rank by rank in execution order."""
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            yield r, a
