"""Measurements of real training runs: `planner smoke`'s smoke.json here, and each engine's training log through its
wing's logs part (planner.engines.megatron.logs, planner.engines.deepspeed.logs, which name the formats they read).

Torch-free text parsing. Every reader returns a :class:`RunMeasurement`: the
steady-state step time (seconds) and, where the run recorded it, each rank's
peak allocated and reserved device memory (bytes), plus what the log says about
the layout that ran, so that :mod:`planner.check.calibrate` can refuse a log
that does not belong to the plan it is paired with.

The first logged interval holds the warm-up (compilation, allocator growth,
NCCL set-up) and is dropped when later ones exist; the step time is the median
of the rest.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.errors import UsageError
from planner.fileio import loads_json_bounded, read_text_bounded

MIB = 2**20
#: the largest training log read (bytes): months of per-iteration lines
MAX_LOG_BYTES = 1024 * MIB
GIB = 2**30


@dataclass(frozen=True)
class RunMeasurement:
    """What one run measured. Times in seconds, memory in bytes, ranks are global ranks."""

    source: str  # the file it was read from
    kind: str  # "smoke" | "megatron" | "deepspeed"
    step_times_s: tuple[float, ...]  # steady-state step times (warm-up removed), one per step or logged interval
    peak_allocated: dict[int, int] = field(default_factory=dict)
    peak_reserved: dict[int, int] = field(default_factory=dict)
    global_batch: int | None = None
    micro_batch: int | None = None
    num_microbatches: int | None = None
    stage_pieces: dict[int, tuple[int, int]] = field(default_factory=dict)  # DeepSpeed: stage -> [start, stop) pieces
    arguments: dict[str, str] = field(default_factory=dict)  # Megatron's printed arguments
    device: str = ""
    world_size: int | None = None
    smoke: dict[str, Any] = field(default_factory=dict)  # the smoke.json document (kind "smoke")
    per_sample: bool = False  # step_times_s are seconds per sample (DeepSpeed's throughput lines): see step_time

    def step_time(self, global_batch: int) -> float:
        """Median steady-state step time (seconds) of a step of ``global_batch`` samples."""
        t = statistics.median(self.step_times_s)
        return t * global_batch if self.per_sample else t


def _bad(path: str, what: str, hint: str) -> UsageError:
    return UsageError(f"{path}: {what}", hint=hint)


def _steady(times: list[float]) -> list[float]:
    return times[1:] if len(times) > 1 else times


# --------------------------------------------------------------------------- smoke.json


def read_smoke(path: str | Path) -> RunMeasurement:
    """The measurement in a smoke.json: per-rank step times (median without the first, warm-up, step; the
    slowest rank's is the step) and peak memory. Reads ``per_rank`` (step times already past warm-up,
    ``peak_allocated_bytes``, ``peak_reserved_bytes``) when present, else ``ranks_stats``."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"cannot read {path}: no such file.", "Run `planner smoke PLAN_DIR` first: it writes PLAN_DIR/smoke.json.")
    doc = loads_json_bounded(read_text_bounded(path, "smoke.json"), str(path))
    if not isinstance(doc, dict):
        raise _bad(str(path), "is not a smoke.json (not a JSON object).", "Re-run `planner smoke` to write it again.")
    failed = [c for c in doc.get("checks") or [] if isinstance(c, dict) and not c.get("ok", True)]
    if failed or doc.get("ok") is False:
        first = failed[0] if failed else {"name": "smoke", "detail": "not ok"}
        raise UsageError(
            f"{path} records a failed run ({first.get('name')}: {str(first.get('detail', '')).splitlines()[0] if first.get('detail') else 'failed'}); "
            "a failed run measures nothing to calibrate from.",
            "Fix the run (`planner smoke` prints why it failed) and calibrate from a run that passed.",
        )
    if doc.get("trained") is False:
        raise UsageError(
            f"{path} records no training run (engine {doc.get('engine')}: flags were only checked).",
            "Calibrate a Megatron-LM plan from its training log: --log LOGFILE PLAN_DIR.",
        )
    per_rank = doc.get("per_rank")
    rows = per_rank if isinstance(per_rank, list) and per_rank else doc.get("ranks_stats") or []
    already_steady = rows is per_rank
    times: dict[int, float] = {}
    alloc: dict[int, int] = {}
    reserved: dict[int, int] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise _bad(str(path), f"rank entry {i} is not an object.", "Re-run `planner smoke` to write it again.")
        rank = int(row.get("rank", i))
        st = row.get("step_times_s") or []
        if not isinstance(st, list) or not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in st):
            raise _bad(str(path), f"rank {rank}'s step_times_s is not a list of positive seconds: {st!r}.", "Re-run `planner smoke` to write it again.")
        if st:
            times[rank] = statistics.median(st if already_steady else _steady(list(st)))
        a = row.get("peak_allocated_bytes", row.get("peak_memory_bytes"))
        if isinstance(a, (int, float)) and a > 0:
            alloc[rank] = int(a)
        r = row.get("peak_reserved_bytes")
        if isinstance(r, (int, float)) and r > 0:
            reserved[rank] = int(r)
    if not times:
        raise UsageError(
            f"{path} holds no step times (no per-rank stats).",
            "Re-run `planner smoke PLAN_DIR --steps 3` or more: calibration needs at least two steps (one is warm-up).",
        )
    env = doc.get("environment") if isinstance(doc.get("environment"), dict) else {}
    lay = doc.get("layout") or {}
    return RunMeasurement(
        source=str(path),
        kind="smoke",
        step_times_s=(max(times.values()),),
        peak_allocated=alloc,
        peak_reserved=reserved,
        global_batch=lay.get("global_batch"),
        micro_batch=lay.get("micro_batch"),
        num_microbatches=lay.get("num_microbatches"),
        device=str(env.get("device") or doc.get("device") or ""),
        world_size=env.get("world_size") or doc.get("ranks"),
        smoke=doc,
    )


# --------------------------------------------------------------------------- engine logs

_FAILURES = (
    (re.compile(r"Traceback \(most recent call last\)"), "a Python traceback"),
    (re.compile(r"(CUDA|HIP) out of memory|OutOfMemoryError"), "an out-of-memory error"),
    (re.compile(r"ChildFailedError|exitcode\s*:\s*-?[1-9]"), "a failed worker process"),
)

# Megatron-LM


def _num(path: str, lineno: int, text: str, what: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise _bad(
            f"{path}:{lineno}", f"{what} {text!r} is not a number.", "The log line is damaged or was written by a different version; fix or drop that line."
        ) from None
    if not math.isfinite(x):
        raise UsageError(
            f"{path}:{lineno}: {what} is {text}: the run failed (a non-finite value), so it measures nothing to calibrate from.",
            "Calibrate from a run that trained normally.",
        )
    return x


def _check_failed(path: str, lines: list[str]) -> None:
    for i, line in enumerate(lines, 1):
        for pat, what in _FAILURES:
            if pat.search(line):
                raise UsageError(
                    f"{path}:{i}: the log shows {what} ({line.strip()[:120]}): the run failed, so it measures nothing to calibrate from.",
                    "Calibrate from the log of a run that finished.",
                )


def read_log(path: str | Path) -> RunMeasurement:
    """Read a training log of an engine that has a log reader (each wing's logs part: planner.engines.spec), the
    engine recognised from its lines."""
    from planner.engines import ENGINES

    path = Path(path)
    if not path.exists():
        raise UsageError(f"cannot read log {path}: no such file.", "Pass the file the training run's stdout was written to.")
    text = read_text_bounded(path, "log", MAX_LOG_BYTES, errors="replace")
    lines = text.splitlines()
    _check_failed(str(path), lines)
    readers = [spec.part("logs") for spec in ENGINES.values() if spec.has("logs")]
    for reader in readers:
        if reader.recognise(lines):
            return reader.parse(lines, str(path))
    raise UsageError(
        f"{path} has no step timing lines of " + " or ".join(f"{r.ENGINE_TEXT} ({r.LINE_TEXT})" for r in readers) + ".",
        "Pass the training run's stdout; " + "; ".join(r.HINT for r in readers) + ".",
    )
