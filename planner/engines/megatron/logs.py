"""Megatron-LM's training log, for ``planner calibrate`` (formats from Megatron-LM core_v0.16.1):
``megatron/training/training.py`` ``training_log``::

    [2025-..] iteration       10/     100 | consumed samples:  640 | elapsed time per iteration (ms): 1234.5 |
    ... | global batch size:    64 | lm loss: 1.0E+01 | ... | number of nan iterations:   0 |

``megatron/training/utils.py`` ``report_memory`` (MB = 2**20 bytes)::

    [Rank 0] (after 10 iterations) memory (MB) | allocated: 1.00 | max allocated: 2.00 | reserved: 3.00 | max reserved: 4.00

and the arguments block of ``megatron/training/arguments.py`` ``_print_args``
(``  pipeline_model_parallel_size .......... 2``).
"""

from __future__ import annotations

import re

from planner.check.run_logs import MIB, RunMeasurement, _bad, _num, _steady
from planner.errors import UsageError

ENGINE_TEXT = "Megatron-LM"
LINE_TEXT = "'iteration N/M | ... elapsed time per iteration (ms): ...'"
HINT = "Megatron logs every --log-interval iterations"
#: how far the log's global batch may be from the plan's (Megatron prints it exactly)
GLOBAL_BATCH_TOLERANCE = 0.0

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


def recognise(lines: list[str]) -> bool:
    return any(_MEG_ELAPSED.search(l) or _MEG_ITER.search(l) for l in lines)


def parse(lines: list[str], path: str = "<log>") -> RunMeasurement:
    return parse_megatron(lines, path)


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
