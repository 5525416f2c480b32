"""Device time model: seconds for matmul FLOPs and memory-bound bytes on one device."""

from __future__ import annotations

import math

from planner.hardware.cluster import _check_bytes
from planner.hardware.profiles import MATMUL_SIZE_SCALE, MEMORY_SIZE_SCALE, DeviceProfile, normalize_dtype

__all__ = ["MATMUL_SIZE_SCALE", "MEMORY_SIZE_SCALE", "matmul_efficiency_at", "matmul_time", "memory_efficiency_at", "memory_time", "size_scale"]


def matmul_efficiency_at(flops_per_op: float, device: DeviceProfile, dtype: str | None = None) -> float:
    """Fraction of the ``dtype`` dense peak that one matmul of ``flops_per_op`` FLOPs reaches on ``device``: FP8 GEMMs
    by the profile's own FP8 ceiling and size curve where it has them (efficiency.matmul_fp8), else the matmul ones;
    both times the share of them the device sustains through a training step (efficiency.sustained)."""
    if dtype is not None and device.matmul_fp8_efficiency > 0 and normalize_dtype(dtype) == "fp8":
        return device.sustained_matmul * device.matmul_fp8_efficiency * size_scale(flops_per_op, device.matmul_fp8_size_scale or device.matmul_size_scale)
    return device.sustained_matmul * device.matmul_efficiency * size_scale(flops_per_op, device.matmul_size_scale)


def matmul_time(flops: float, device: DeviceProfile, dtype: str, flops_per_op: float | None = None) -> float:
    """Seconds for ``flops`` FLOPs of matmul: flops / (peak(dtype) * matmul_efficiency_at(op size)).

    ``flops_per_op`` is the size of each matmul when ``flops`` sums several; it defaults to ``flops``.
    """
    if not flops >= 0:
        raise ValueError(f"flops must be >= 0, got {flops!r}")
    if flops == 0:
        return 0.0
    size = flops if flops_per_op is None else flops_per_op
    return flops / (device.flops(dtype) * matmul_efficiency_at(size, device, dtype))


def size_scale(x: float, pts: tuple[tuple[float, float], ...]) -> float:
    """y at ``x`` on the curve ``pts`` (joined linearly in log x, flat beyond its ends)."""
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            t = math.log(x / x0) / math.log(x1 / x0)
            return y0 + t * (y1 - y0)
    return pts[-1][1]


def memory_efficiency_at(bytes_per_op: float, device: DeviceProfile) -> float:
    """Fraction of memory bandwidth one operator moving ``bytes_per_op`` bytes reaches on ``device``."""
    return device.memory_efficiency * size_scale(bytes_per_op, device.memory_size_scale)


def memory_time(nbytes: float, device: DeviceProfile, bytes_per_op: float | None = None) -> float:
    """Seconds to stream ``nbytes`` through device memory: bytes / (bandwidth * memory efficiency).

    With ``bytes_per_op`` the efficiency is that of operators of that size (small ones reach
    less of the bandwidth); without it, the device's large-transfer efficiency.
    """
    _check_bytes(nbytes)
    eff = device.memory_efficiency if bytes_per_op is None else memory_efficiency_at(bytes_per_op, device)
    return nbytes / (device.memory_bandwidth * eff)
