"""Measurements of real training runs: `planner smoke`'s smoke.json, Megatron-LM and DeepSpeed logs.

Torch-free text parsing. Every reader returns a :class:`RunMeasurement`: the
steady-state step time (seconds) and, where the run recorded it, each rank's
peak allocated and reserved device memory (bytes), plus what the log says about
the layout that ran, so that :mod:`planner.check.calibrate` can refuse a log
that does not belong to the plan it is paired with.

Formats (copied from the engines' sources; the fixtures in tests/fixtures/logs
name the file and version of each):

* Megatron-LM (core_v0.16.1), ``megatron/training/training.py`` ``training_log``::

      [2025-..] iteration       10/     100 | consumed samples:  640 | elapsed time per iteration (ms): 1234.5 |
      ... | global batch size:    64 | lm loss: 1.0E+01 | ... | number of nan iterations:   0 |

  and ``megatron/training/utils.py`` ``report_memory`` (MB = 2**20 bytes)::

      [Rank 0] (after 10 iterations) memory (MB) | allocated: 1.00 | max allocated: 2.00 | reserved: 3.00 | max reserved: 4.00

  and the arguments block of ``megatron/training/arguments.py`` ``_print_args``
  (``  pipeline_model_parallel_size .......... 2``).
* DeepSpeed (0.19.8): ``runtime/pipe/engine.py`` ``train_batch``
  (``steps: 10 loss: 2.3456 iter time (s): 0.123 samples/sec: 130.081``), ``utils/timer.py``
  ``ThroughputTimer.stop`` (``epoch=0/micro_step=10/global_step=10, RunningAvgSamplesPerSec=...,
  CurrSamplesPerSec=..., MemAllocated=0.5GB, MaxMemAllocated=0.6GB``), ``runtime/utils.py``
  ``see_memory_usage`` (``MA 0.5 GB  Max_MA 0.6 GB  CA 0.7 GB  Max_CA 1 GB``, GB = 2**30 bytes,
  Max_CA rounded to whole GB), and ``PipelineEngine.__init__``'s
  ``RANK=0 STAGE=0 LAYERS=4 [0, 4) STAGE_PARAMS=... TOTAL_PARAMS=... UNIQUE_PARAMS=...`` and
  ``CONFIG: micro_batches=4 micro_batch_size=2``.

The first logged interval holds the warm-up (compilation, allocator growth,
NCCL set-up) and is dropped when later ones exist; the step time is the median
of the rest.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.errors import UsageError

MIB = 2**20
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
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}.", "Run `planner smoke PLAN_DIR` first: it writes PLAN_DIR/smoke.json.") from None
    except json.JSONDecodeError as e:
        raise _bad(str(path), f"is not valid JSON ({e.msg}, line {e.lineno}).", "Re-run `planner smoke` to write it again.") from None
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
_MEG_ITER = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_MEG_ELAPSED = re.compile(r"elapsed time per iteration \(ms\):\s*([^|\s]+)\s*\|")
_MEG_GBS = re.compile(r"global batch size:\s*(\d+)\s*\|")
_MEG_NAN = re.compile(r"number of nan iterations:\s*(\d+)")
_MEG_MEM = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\)(.*)$")
_MEG_MEM_FIELD = re.compile(r"\|\s*(allocated|max allocated|reserved|max reserved|total device memory used):\s*([^|\s]+)")
_MEG_ARGS_START = re.compile(r"^-+ arguments -+$")
_MEG_ARGS_END = re.compile(r"^-+ end of arguments -+$")
_MEG_ARG = re.compile(r"^\s+(\w+) \.+ (.*)$")

# DeepSpeed
_DS_PIPE_STEP = re.compile(r"\bsteps: (\d+) loss: (\S+) .*?iter time \(s\): ([^\s]+) samples/sec: ([^\s]+)")
_DS_TPUT = re.compile(
    r"epoch=(\d+)/micro_step=(\d+)/global_step=(\d+), RunningAvgSamplesPerSec=([^,]+), CurrSamplesPerSec=([^,]+), "
    r"MemAllocated=([^G]+)GB, MaxMemAllocated=([^G]+)GB"
)
_DS_SEE_MEM = re.compile(r"\bMA ([^\s]+) GB\s+Max_MA ([^\s]+) GB\s+CA ([^\s]+) GB\s+Max_CA ([^\s]+) GB")
_DS_STAGE = re.compile(r"RANK=(\d+) STAGE=(\d+) LAYERS=(\d+) \[(\d+), (\d+)\) STAGE_PARAMS=(\d+) .*?UNIQUE_PARAMS=(\d+)")
_DS_CONFIG = re.compile(r"CONFIG: micro_batches=(\d+) micro_batch_size=(\d+)")


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
    """Read a Megatron-LM or DeepSpeed training log (the engine is recognised from its lines)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise UsageError(f"cannot read log {path}: {e.strerror or e}.", "Pass the file the training run's stdout was written to.") from None
    lines = text.splitlines()
    _check_failed(str(path), lines)
    if any(_MEG_ELAPSED.search(l) or _MEG_ITER.search(l) for l in lines):
        return parse_megatron(lines, str(path))
    if any(_DS_PIPE_STEP.search(l) or _DS_TPUT.search(l) or "iter time (s)" in l or "CurrSamplesPerSec" in l for l in lines):
        return parse_deepspeed(lines, str(path))
    raise UsageError(
        f"{path} has no step timing lines of Megatron-LM ('iteration N/M | ... elapsed time per iteration (ms): ...') "
        "or DeepSpeed ('steps: N loss: ... iter time (s): ...' or '... CurrSamplesPerSec=...').",
        "Pass the training run's stdout; Megatron logs every --log-interval iterations, DeepSpeed every steps_per_print steps "
        "(set steps_per_print in ds_config.json and run more steps than that).",
    )


def parse_megatron(lines: list[str], path: str = "<log>") -> RunMeasurement:
    """Megatron-LM's iteration lines, memory reports and arguments block (formats in the module docstring)."""
    times: list[float] = []
    gbs: set[int] = set()
    alloc: dict[int, int] = {}
    reserved: dict[int, int] = {}
    args: dict[str, str] = {}
    in_args = False
    for i, line in enumerate(lines, 1):
        s = line.strip()
        if _MEG_ARGS_START.match(s):
            in_args = True
            continue
        if _MEG_ARGS_END.match(s):
            in_args = False
            continue
        if in_args:
            m = _MEG_ARG.match(line)
            if m:
                args[m.group(1)] = m.group(2).strip()
            continue
        if _MEG_ITER.search(line) or "elapsed time per iteration" in line:
            e = _MEG_ELAPSED.search(line)
            if not _MEG_ITER.search(line) or not e:
                raise _bad(
                    f"{path}:{i}",
                    f"is a damaged Megatron-LM iteration line: {s[:160]!r}.",
                    "Expected 'iteration N/M | ... | elapsed time per iteration (ms): X | ...' "
                    "(megatron/training/training.py training_log); fix or drop that line.",
                )
            ms = _num(path, i, e.group(1), "elapsed time per iteration (ms)")
            if ms <= 0:
                raise _bad(f"{path}:{i}", f"elapsed time per iteration is {ms} ms.", "Fix or drop that line.")
            nan = _MEG_NAN.search(line)
            if nan and int(nan.group(1)) > 0:
                raise UsageError(
                    f"{path}:{i}: {nan.group(1)} NaN iterations: the run failed, so it measures nothing to calibrate from.",
                    "Calibrate from a run that trained normally.",
                )
            g = _MEG_GBS.search(line)
            if g:
                gbs.add(int(g.group(1)))
            times.append(ms / 1e3)
            continue
        m = _MEG_MEM.search(line)
        if m:
            fields = {k: _num(path, i, v, k) for k, v in _MEG_MEM_FIELD.findall(m.group(3))}
            if "max allocated" not in fields or "max reserved" not in fields:
                raise _bad(
                    f"{path}:{i}",
                    f"is a damaged Megatron-LM memory report: {s[:160]!r}.",
                    "Expected '[Rank R] (after N iterations) memory (MB) | allocated: A | max allocated: B | reserved: C | max reserved: D' "
                    "(megatron/training/utils.py report_memory).",
                )
            rank = int(m.group(1))
            alloc[rank] = max(alloc.get(rank, 0), int(fields["max allocated"] * MIB))
            reserved[rank] = max(reserved.get(rank, 0), int(fields["max reserved"] * MIB))
    if not times:
        raise UsageError(
            f"{path} has no Megatron-LM iteration lines with 'elapsed time per iteration (ms)'.",
            "Run more iterations than --log-interval, and pass the log of the last pipeline rank (it prints them).",
        )
    if len(gbs) > 1:
        raise UsageError(
            f"{path}: the global batch size changes during the run ({', '.join(map(str, sorted(gbs)))}; batch-size ramp-up).",
            "Calibrate from a run with a fixed global batch (no --rampup-batch-size).",
        )
    return RunMeasurement(
        source=path,
        kind="megatron",
        step_times_s=tuple(_steady(times)),
        peak_allocated=alloc,
        peak_reserved=reserved,
        global_batch=next(iter(gbs)) if gbs else _int_arg(args, "global_batch_size"),
        micro_batch=_int_arg(args, "micro_batch_size"),
        arguments=args,
        world_size=_int_arg(args, "world_size"),
    )


def _int_arg(args: dict[str, str], key: str) -> int | None:
    try:
        return int(args[key])
    except (KeyError, ValueError):
        return None


def parse_deepspeed(lines: list[str], path: str = "<log>") -> RunMeasurement:
    """DeepSpeed's pipeline step lines (or ThroughputTimer lines), memory lines and pipeline layout lines."""
    pipe_times: list[float] = []
    tput_times: list[float] = []
    batches: set[int] = set()
    alloc: dict[int, int] = {}
    reserved: dict[int, int] = {}
    stages: dict[int, tuple[int, int]] = {}
    mb = mbs = None
    for i, line in enumerate(lines, 1):
        s = line.strip()
        m = _DS_PIPE_STEP.search(line)
        if m:
            _num(path, i, m.group(2), "loss")  # a NaN loss means the run failed
            t = _num(path, i, m.group(3), "iter time (s)")
            rate = _num(path, i, m.group(4), "samples/sec")
            if t <= 0 or rate <= 0:
                raise _bad(f"{path}:{i}", f"iter time {t} s at {rate} samples/s is not a measurement.", "Fix or drop that line.")
            pipe_times.append(t)
            batches.add(round(t * rate))
            continue
        if "iter time (s)" in line and s.startswith("steps:"):
            raise _bad(
                f"{path}:{i}",
                f"is a damaged DeepSpeed step line: {s[:160]!r}.",
                "Expected 'steps: N loss: L iter time (s): T samples/sec: R' (deepspeed/runtime/pipe/engine.py train_batch).",
            )
        m = _DS_TPUT.search(line)
        if m:
            rate = _num(path, i, m.group(5), "CurrSamplesPerSec")
            if rate <= 0:
                raise _bad(f"{path}:{i}", f"CurrSamplesPerSec is {rate}.", "Fix or drop that line.")
            tput_times.append(1.0 / rate)  # seconds per sample; times the global batch below
            peak = _num(path, i, m.group(7), "MaxMemAllocated")
            if peak > 0:
                alloc[0] = max(alloc.get(0, 0), int(peak * GIB))
            continue
        if "CurrSamplesPerSec" in line:
            raise _bad(
                f"{path}:{i}",
                f"is a damaged DeepSpeed throughput line: {s[:160]!r}.",
                "Expected 'epoch=E/micro_step=M/global_step=G, RunningAvgSamplesPerSec=..., CurrSamplesPerSec=..., "
                "MemAllocated=...GB, MaxMemAllocated=...GB' (deepspeed/utils/timer.py ThroughputTimer).",
            )
        m = _DS_SEE_MEM.search(line)
        if m:
            alloc[0] = max(alloc.get(0, 0), int(_num(path, i, m.group(2), "Max_MA") * GIB))
            reserved[0] = max(reserved.get(0, 0), int(_num(path, i, m.group(4), "Max_CA") * GIB))
            continue
        m = _DS_STAGE.search(line)
        if m:
            stages[int(m.group(2))] = (int(m.group(4)), int(m.group(5)))
            continue
        m = _DS_CONFIG.search(line)
        if m:
            mb, mbs = int(m.group(1)), int(m.group(2))
    gb = next(iter(batches)) if len(batches) == 1 else None
    if pipe_times:
        times = pipe_times
    elif tput_times:
        times = tput_times  # seconds per sample: the data-parallel degree is not in the log (see per_sample)
    else:
        raise UsageError(f"{path} has no DeepSpeed step lines.", "Set steps_per_print in ds_config.json below the number of steps run.")
    return RunMeasurement(
        source=path,
        kind="deepspeed",
        step_times_s=tuple(_steady(times)),
        per_sample=not pipe_times,
        peak_allocated=alloc,
        peak_reserved=reserved,
        global_batch=gb,
        micro_batch=mbs,
        num_microbatches=mb,
        stage_pieces=stages,
    )
