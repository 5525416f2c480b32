"""The device a profile runs on: its name and memory, a phase timer (CUDA events or perf_counter), and
``calibrate_device``, which measures the achieved matmul FLOP/s per dtype and the copy bandwidth (bytes/s)."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from planner import hardware
from planner.errors import UsageError
from planner.model.analyze import torch_dtype

DEVICES = ("cpu", "cuda")
#: default calibration sizes: square matmul sides (n) and the bytes of the copied tensor
CALIBRATION: dict[str, dict[str, Any]] = {
    "cpu": {"matmul_sizes": (512, 1024, 2048), "copy_bytes": 256 * 2**20},
    "cuda": {"matmul_sizes": (2048, 4096, 8192), "copy_bytes": 2 * 2**30},
}


def _cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def _meminfo() -> dict[str, int]:
    """MemTotal and MemAvailable in bytes from /proc/meminfo (empty when unreadable)."""
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if key in ("MemTotal", "MemAvailable") and parts:
                out[key] = int(parts[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def check_device(device: str) -> None:
    if device not in DEVICES:
        raise UsageError(f"Unknown device {device!r} for profiling.", "Use --device cuda (the GPU of this machine) or --device cpu.")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "--device cuda was asked for, but torch sees no CUDA GPU on this machine.",
            "Run `planner profile` on a machine with the target GPU, or profile with --device cpu.",
        )


def device_name(device: str) -> str:
    """The device's model name: torch.cuda.get_device_name, or the CPU model from /proc/cpuinfo."""
    return torch.cuda.get_device_name() if device == "cuda" else _cpu_model_name()


def device_memory(device: str) -> tuple[int, int]:
    """(total, currently free) bytes of the device: CUDA's figures, or /proc/meminfo's MemTotal and MemAvailable."""
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        return int(total), int(free)
    info = _meminfo()
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total), int(info.get("MemAvailable", total))


def hardware_key_for(name: str, device: str, profiles: Mapping[str, Any] | None = None) -> str | None:
    """The hardware-profile key of a device name (planner.hardware.resolve_device), ``cpu`` for an unknown CPU, else None."""
    profiles = hardware.available_profiles() if profiles is None else profiles
    try:
        return hardware.resolve_device(name, profiles)[0].key
    except UsageError:
        return "cpu" if device == "cpu" and "cpu" in profiles else None


# --------------------------------------------------------------------------- timing


class Timer:
    """Times consecutive phases of one iteration: CUDA events on GPU, perf_counter on CPU (seconds)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.marks: list[list[Any]] = []

    def start(self) -> None:
        self.marks.append([])
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks[-1].append(e)
        else:
            self.marks[-1].append(time.perf_counter())

    def phases(self) -> list[list[float]]:
        """Per iteration, the seconds between consecutive marks."""
        if self.cuda:
            torch.cuda.synchronize()
            return [[a.elapsed_time(b) / 1e3 for a, b in zip(m, m[1:])] for m in self.marks]
        return [[b - a for a, b in zip(m, m[1:])] for m in self.marks]


def summarize(samples: list[float]) -> dict[str, float]:
    """Median, min, max and quartiles (inclusive method) of ``samples`` (seconds)."""
    xs = sorted(samples)
    if len(xs) >= 2:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "q1": q1, "q3": q3}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- calibration


def calibrate_device(
    device: str,
    dtypes: tuple[str, ...] = ("fp32",),
    matmul_sizes: tuple[int, ...] | None = None,
    copy_bytes: int | None = None,
    repeats: int = 5,
) -> dict[str, Any]:
    """Achieved matmul FLOP/s per dtype and copy bandwidth of ``device``.

    Matmul: for each side ``n`` in ``matmul_sizes``, the median rate of ``repeats``
    ``(n x n) @ (n x n)`` products (2 n^3 FLOPs each); the reported rate is the
    largest size's (the large-GEMM rate a profile's peak describes; smaller sizes
    are kept in ``by_size``, e.g. to see how a CPU departs from the GPU-derived
    size curve of planner.hardware). Copy: ``y.copy_(x)`` of ``copy_bytes`` bytes, rate = 2 x bytes / median
    time (read + write, as the costing counts bytes moved).
    """
    check_device(device)
    sizes: tuple[int, ...] = tuple(matmul_sizes or CALIBRATION[device]["matmul_sizes"])
    nbytes = int(copy_bytes or CALIBRATION[device]["copy_bytes"])
    timer_name = "cuda events" if device == "cuda" else "perf_counter"
    matmul: dict[str, Any] = {}
    for name in dtypes:
        dt = torch_dtype(name)
        by_size = []
        for n in sizes:
            a = torch.randn(n, n, device=device).to(dt)
            b = torch.randn(n, n, device=device).to(dt)
            torch.mm(a, b)
            sync(device)
            t = Timer(device)
            for _ in range(repeats):
                t.start()
                torch.mm(a, b)
                t.mark()
            secs = statistics.median(p[0] for p in t.phases())
            by_size.append({"n": n, "flops_per_op": 2.0 * n**3, "median_s": secs, "flops_per_s": 2.0 * n**3 / secs})
            del a, b
        top = max(by_size, key=lambda r: r["n"])
        matmul[name] = {"n": top["n"], "flops_per_op": top["flops_per_op"], "flops_per_s": top["flops_per_s"], "by_size": by_size}
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    t = Timer(device)
    for _ in range(repeats):
        t.start()
        y.copy_(x)
        t.mark()
    secs = statistics.median(p[0] for p in t.phases())
    copied = x.numel() * 4
    del x, y
    total, free = device_memory(device)
    return {
        "matmul": matmul,
        "copy": {"bytes": copied, "median_s": secs, "bytes_per_s": 2.0 * copied / secs},
        "memory_total_bytes": total,
        "memory_available_bytes": free,
        "repeats": repeats,
        "timer": timer_name,
    }
