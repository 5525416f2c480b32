"""Text for ``planner hardware list`` and ``planner hardware show``: rows with units, no printing."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from planner.hardware.profiles import GB, GIB, DeviceProfile

# ------------------------------------------------------------------ CLI rendering helpers


def _g(x: float) -> str:
    """Compact number: 312, 989.4, 0.05, 1,555."""
    return f"{x:,.0f}" if float(x).is_integer() and abs(x) >= 1000 else f"{x:g}"


def intra_link_text(p: DeviceProfile) -> str:
    """One-line description of the intra-node link, e.g. 'pairs 300 GB/s, else PCIe 32 GB/s'."""
    bw, pcie = _g(p.intra_bandwidth / GB), _g(p.pcie_bandwidth / GB)
    return {
        "switch": f"switch {bw} GB/s",
        "pairs": f"pairs {bw} GB/s, else PCIe {pcie} GB/s",
        "pcie": f"PCIe {bw} GB/s",
        "mesh": f"mesh {bw} GB/s per peer",
    }[p.intra_topology]


def profiles_table_rows(profiles: Mapping[str, DeviceProfile] | Iterable[DeviceProfile]) -> list[dict[str, Any]]:
    """Rows for ``planner hardware list``, sorted by key; units are in the key names.

    ``usable_memory_gib`` is the allocatable memory (GiB), ``bf16_tflops`` the dense
    peak (None when the device has no bf16), bandwidths GB/s per direction.
    """
    items = profiles.values() if isinstance(profiles, Mapping) else profiles
    rows = []
    for p in sorted(items, key=lambda p: p.key):
        bf16 = p.peak_flops.get("bf16")
        rows.append(
            {
                "key": p.key,
                "name": p.name,
                "usable_memory_gib": round(p.memory_bytes / GIB, 1),
                "bf16_tflops": None if bf16 is None else bf16 / 1e12,
                "memory_bandwidth_gbps": p.memory_bandwidth / GB,
                "intra_link": intra_link_text(p),
                "inter_node_gbps_per_gpu": p.inter_bandwidth / GB,
                "gpus_per_node": p.gpus_per_node,
                "measured_at_runtime": p.measured_at_runtime,
            }
        )
    return rows


def describe_profile(profile: DeviceProfile) -> list[tuple[str, str, str]]:
    """(field, value with unit, source) rows for ``planner hardware show NAME``."""
    p, src = profile, profile.sources

    def s(group: str, sub: str | None = None) -> str:
        return src.get(f"{group}.{sub}") or src.get(group, "") if sub else src.get(group, "")

    rows = [
        ("key", p.key, p.path),
        ("name", p.name, ""),
        ("aliases", ", ".join(p.aliases) or "-", ""),
        ("memory_gib", f"{_g(p.marketed_memory_gib)} GiB (marketed)", s("memory_gib")),
        ("usable_memory_bytes", f"{p.memory_bytes:,} B = {p.memory_bytes / GIB:.2f} GiB", s("usable_memory_bytes")),
    ]
    rows += [(f"peak_tflops.{d}", f"{_g(f / 1e12)} TFLOP/s dense", s("peak_tflops", d)) for d, f in p.peak_flops.items()]
    rows += [
        ("memory_bandwidth_gbps", f"{_g(p.memory_bandwidth / GB)} GB/s", s("memory_bandwidth_gbps")),
        ("intra_node.topology", p.intra_topology, s("intra_node")),
        ("intra_node.bandwidth_gbps_per_direction", f"{_g(p.intra_bandwidth / GB)} GB/s per direction", s("intra_node", "bandwidth_gbps_per_direction")),
        ("intra_node.latency_us", f"{_g(p.intra_latency * 1e6)} us", s("intra_node", "latency_us")),
        ("pcie_gbps_per_direction", f"{_g(p.pcie_bandwidth / GB)} GB/s per direction", s("pcie_gbps_per_direction")),
        (
            "inter_node.bandwidth_gbps_per_direction",
            f"{_g(p.inter_bandwidth / GB)} GB/s per GPU per direction ({_g(p.inter_bandwidth * 8 / 1e9)} Gb/s)",
            s("inter_node", "bandwidth_gbps_per_direction"),
        ),
        ("inter_node.latency_us", f"{_g(p.inter_latency * 1e6)} us", s("inter_node", "latency_us")),
        ("inter_node.fabric", p.inter_fabric or "-", s("inter_node")),
        ("gpus_per_node", str(p.gpus_per_node), s("gpus_per_node")),
        ("efficiency.matmul", f"{p.matmul_efficiency:g} of peak (large GEMMs)", s("efficiency", "matmul")),
        ("efficiency.memory", f"{p.memory_efficiency:g} of bandwidth", s("efficiency", "memory")),
        ("efficiency.allreduce_intra", f"{p.allreduce_efficiency_intra:g} of link (busbw)", s("efficiency", "allreduce_intra")),
        ("efficiency.allreduce_inter", f"{p.allreduce_efficiency_inter:g} of link (busbw)", s("efficiency", "allreduce_inter")),
    ]
    if p.matmul_fp8_efficiency > 0:
        rows.append(("efficiency.matmul_fp8", f"{p.matmul_fp8_efficiency:g} of the fp8 peak (large FP8 GEMMs)", s("efficiency", "matmul_fp8")))
    if p.sustained_matmul != 1.0:
        rows.append(("efficiency.sustained", f"{p.sustained_matmul:g} of the GEMM rates above, held through a training step", s("efficiency", "sustained")))
    default_curve = "default: after Calculon's a100_80g.json (planner.hardware.profiles)"
    for field, curve, unit in (("matmul_size_scale", p.matmul_size_scale, "FLOPs"), ("memory_size_scale", p.memory_size_scale, "B")):
        text = ", ".join(f"{x:.3g} {unit}: {y:.3f}" for x, y in curve)
        rows.append((f"efficiency.{field}", text, s("efficiency", field) or default_curve))
    if p.measured_at_runtime:
        rows.append(("measured_at_runtime", "yes: placeholders, replaced by calibration", ""))
    return rows
