"""A hardware profile (YAML, planner.hardware schema) from a device calibration measured by `planner profile`.

Torch-free: it reads the calibration record of a profile.json and the bundled profiles.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import yaml

from planner import hardware
from planner.errors import UsageError

_PLACEHOLDER_GPU: dict[str, Any] = {
    "intra_node": {"topology": "pcie", "bandwidth_gbps_per_direction": 25, "latency_us": 10},
    "pcie_gbps_per_direction": 25,
    "inter_node": {"bandwidth_gbps_per_direction": 12.5, "latency_us": 20, "fabric": "assumed: 100 Gb/s Ethernet or InfiniBand per GPU"},
    "allreduce_intra": 0.7,
    "allreduce_inter": 0.7,
}


def suggested_hardware_key(profile: Mapping[str, Any]) -> str:
    """A file stem (= profile key) for the calibrated YAML: the resolved device key, or a slug of the name, + '-calibrated'."""
    dev = profile["device"]
    base = dev.get("key") if dev.get("type") == "cuda" and dev.get("key") else None
    if base is None:
        base = "cpu" if dev.get("type") == "cpu" else "".join(c if c.isalnum() else "-" for c in str(dev.get("name", "gpu")).lower()).strip("-")
    return f"{base}-calibrated"


def profile_to_hardware_yaml(profile: Mapping[str, Any], base_profiles: Mapping[str, Any] | None = None) -> str:
    """A hardware-profile YAML (planner/hardware.py schema) from a profile with ``calibration``.

    Measured: ``peak_tflops`` per calibrated dtype (the achieved matmul rate divided
    by planner.hardware's size factor at the calibration size, with
    ``efficiency.matmul`` 1.0, so matmul_time reproduces the measurement),
    ``memory_bandwidth_gbps`` (copy rate, ``efficiency.memory`` 1.0) and memory
    capacity. Links, latencies and all-reduce efficiencies cannot be measured on
    one device: they come from the bundled profile of the same device (CPU: the
    ``cpu`` placeholder profile) when there is one, else from stated assumptions.
    Save it as ``<key>.yaml`` (the file stem is the key) and pass it with
    ``--hardware-profile``.
    """
    cal = profile.get("calibration")
    if not cal:
        raise UsageError("this profile has no calibration.", "Run `planner profile ... --calibrate` to measure the device's matmul rate and bandwidth.")
    dev = profile["device"]
    name, kind = str(dev["name"]), dev["type"]
    where = f"measured by planner profile --calibrate on {name} ({kind}, torch {dev.get('torch')})"
    profiles = hardware.available_profiles() if base_profiles is None else base_profiles
    base_key = dev.get("key") if dev.get("key") in profiles else ("cpu" if kind == "cpu" and "cpu" in profiles else None)
    base = profiles.get(base_key) if base_key else None

    peak, peak_src = {}, []
    for dt, m in sorted(cal["matmul"].items(), key=lambda kv: hardware.DTYPES.index(kv[0]) if kv[0] in hardware.DTYPES else 99):
        scale = hardware.size_scale(m["flops_per_op"], hardware.MATMUL_SIZE_SCALE)  # the written profile keeps the default curves
        peak[dt] = _round(m["flops_per_s"] / scale / 1e12)
        peak_src.append(
            f"{dt}: {m['flops_per_s'] / 1e12:.4g} TFLOP/s achieved by a {m['n']}x{m['n']} matmul, / size factor {scale:.3f} at {m['flops_per_op']:.3g} FLOP"
        )
    moved = 2.0 * cal["copy"]["bytes"]
    mem_scale = hardware.size_scale(moved, hardware.MEMORY_SIZE_SCALE)
    bw = _round(cal["copy"]["bytes_per_s"] / mem_scale / 1e9)
    total = int(dev.get("memory_bytes") or cal.get("memory_total_bytes"))
    if kind == "cpu":
        avail = int(cal.get("memory_available_bytes") or total)
        usable = min(max(avail, total // 2 + 1), total)
        usable_src = f"MemAvailable from /proc/meminfo at calibration, kept within 50-100% of MemTotal; {where}"
        mem_src = f"MemTotal from /proc/meminfo; {where}"
    else:
        usable = total
        usable_src = f"torch.cuda.mem_get_info total (driver total; context and allocator reserve not subtracted); {where}"
        mem_src = f"torch.cuda.mem_get_info total / 2^30; {where}"

    def from_base(field: str) -> tuple[Any, str]:
        if base is None:
            return None, ""
        src = base.sources.get(field) or " ".join(f"{k}: {v}" for k, v in base.sources.items() if k.startswith(field + "."))
        return base, f"Not measured by calibration: copied from the bundled profile {base.key} ({src})"

    if base is not None:
        _, link_src = from_base("intra_node")
        intra = {
            "topology": base.intra_topology,
            "bandwidth_gbps_per_direction": _round(base.intra_bandwidth / 1e9),
            "latency_us": _round(base.intra_latency * 1e6),
        }
        pcie = _round(base.pcie_bandwidth / 1e9)
        inter = {
            "bandwidth_gbps_per_direction": _round(base.inter_bandwidth / 1e9),
            "latency_us": _round(base.inter_latency * 1e6),
            "fabric": base.inter_fabric or "as in " + base.key,
        }
        gpn = base.gpus_per_node
        ar = (base.allreduce_efficiency_intra, base.allreduce_efficiency_inter)
        srcs = {k: from_base(k)[1] for k in ("intra_node", "pcie_gbps_per_direction", "inter_node", "gpus_per_node")}
        ar_src = f"Not measured by calibration: all-reduce efficiencies copied from the bundled profile {base.key}"
    else:
        p = _PLACEHOLDER_GPU
        intra, pcie, inter = dict(p["intra_node"]), p["pcie_gbps_per_direction"], dict(p["inter_node"])
        gpn = int(dev.get("count") or 8) if kind == "cuda" else 8  # the GPUs the profiling machine had
        ar = (p["allreduce_intra"], p["allreduce_inter"])
        assumed = "Assumption, not measured (calibration times one device only): "
        srcs = {
            "intra_node": assumed + "GPUs talk over PCIe Gen4 x16, ~25 GB/s per direction, 10 us per step. Replace with your node's NVLink figures.",
            "pcie_gbps_per_direction": assumed + "PCIe Gen4 x16, ~25 GB/s per direction.",
            "inter_node": assumed + "one 100 Gb/s NIC share per GPU (12.5 GB/s), 20 us per step. Override with --inter-node-gbps.",
            "gpus_per_node": f"torch.cuda.device_count() on the profiling machine ({gpn})",
        }
        ar_src = assumed + "all-reduce reaches 0.7 of the link bandwidth"
    data = {
        "schema": hardware.SCHEMA_VERSION,
        "name": f"{name} (calibrated)",
        "aliases": [name],
        "memory_gib": _round(total / 2**30),
        "usable_memory_bytes": int(usable),
        "peak_tflops": peak,
        "memory_bandwidth_gbps": bw,
        "intra_node": intra,
        "pcie_gbps_per_direction": pcie,
        "inter_node": inter,
        "gpus_per_node": int(gpn),
        "efficiency": {"matmul": 1.0, "memory": 1.0, "allreduce_intra": ar[0], "allreduce_inter": ar[1]},
        "sources": {
            "memory_gib": mem_src,
            "usable_memory_bytes": usable_src,
            "peak_tflops": "; ".join(peak_src) + f" (so matmul_time reproduces the measured rate at that size); {where}",
            "memory_bandwidth_gbps": f"2 x {cal['copy']['bytes']} bytes / median time of a tensor copy (read + write) = {cal['copy']['bytes_per_s'] / 1e9:.4g} GB/s, / size factor {mem_scale:.3f} at {moved:.3g} bytes (so memory_time reproduces it); {where}",
            **srcs,
            "efficiency.matmul": f"1.0: peak_tflops already is the achieved rate; {where}",
            "efficiency.memory": f"1.0: memory_bandwidth_gbps already is the achieved copy rate; {where}",
            "efficiency.allreduce_intra": ar_src,
            "efficiency.allreduce_inter": ar_src,
        },
    }
    header = (
        f"# Hardware profile calibrated by `planner profile --calibrate` on {name} ({kind}).\n"
        f"# Save as {suggested_hardware_key(profile)}.yaml (the file name is the key) and pass --hardware-profile FILE.\n"
        "# Matmul peak and memory bandwidth are measured; links and all-reduce figures are not (see sources).\n"
    )
    text: str = yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=10_000)
    return header + text


def _round(x: float) -> float:
    """Four significant digits (YAML stays readable; calibration noise is larger)."""
    if x == 0 or not math.isfinite(x):
        return x
    return float(f"{x:.4g}")
