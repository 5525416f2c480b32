"""DeepSpeed's training log, for ``planner calibrate`` (formats from DeepSpeed 0.19.8): ``runtime/pipe/engine.py``
``train_batch`` (``steps: 10 loss: 2.3456 iter time (s): 0.123 samples/sec: 130.081``), ``utils/timer.py``
``ThroughputTimer.stop`` (``epoch=0/micro_step=10/global_step=10, RunningAvgSamplesPerSec=..., CurrSamplesPerSec=...,
MemAllocated=0.5GB, MaxMemAllocated=0.6GB``), ``runtime/utils.py`` ``see_memory_usage`` (``MA 0.5 GB  Max_MA 0.6 GB  CA
0.7 GB  Max_CA 1 GB``, GB = 2**30 bytes, Max_CA rounded to whole GB), and ``PipelineEngine.__init__``'s ``RANK=0
STAGE=0 LAYERS=4 [0, 4) STAGE_PARAMS=... TOTAL_PARAMS=... UNIQUE_PARAMS=...`` and ``CONFIG: micro_batches=4
micro_batch_size=2``.
"""

from __future__ import annotations

import re

from planner.check.run_logs import GIB, RunMeasurement, _bad, _num, _steady
from planner.errors import UsageError

ENGINE_TEXT = "DeepSpeed"
LINE_TEXT = "'steps: N loss: ... iter time (s): ...' or '... CurrSamplesPerSec=...'"
HINT = "DeepSpeed every steps_per_print steps (set steps_per_print in ds_config.json and run more steps than that)"
#: how far the log's global batch may be from the plan's: DeepSpeed logs samples per second, from which the batch is derived
GLOBAL_BATCH_TOLERANCE = 0.05

_DS_PIPE_STEP = re.compile(r"\bsteps: (\d+) loss: (\S+) .*?iter time \(s\): ([^\s]+) samples/sec: ([^\s]+)")
_DS_TPUT = re.compile(
    r"epoch=(\d+)/micro_step=(\d+)/global_step=(\d+), RunningAvgSamplesPerSec=([^,]+), CurrSamplesPerSec=([^,]+), "
    r"MemAllocated=([^G]+)GB, MaxMemAllocated=([^G]+)GB"
)
_DS_SEE_MEM = re.compile(r"\bMA ([^\s]+) GB\s+Max_MA ([^\s]+) GB\s+CA ([^\s]+) GB\s+Max_CA ([^\s]+) GB")
_DS_STAGE = re.compile(r"RANK=(\d+) STAGE=(\d+) LAYERS=(\d+) \[(\d+), (\d+)\) STAGE_PARAMS=(\d+) .*?UNIQUE_PARAMS=(\d+)")
_DS_CONFIG = re.compile(r"CONFIG: micro_batches=(\d+) micro_batch_size=(\d+)")


def recognise(lines: list[str]) -> bool:
    return any(_DS_PIPE_STEP.search(l) or _DS_TPUT.search(l) or "iter time (s)" in l or "CurrSamplesPerSec" in l for l in lines)


def parse(lines: list[str], path: str = "<log>") -> RunMeasurement:
    return parse_deepspeed(lines, path)


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
