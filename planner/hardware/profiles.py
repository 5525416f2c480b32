"""Device profiles: the YAML schema, loading, and device-name resolution.

Torch-free. Units: see planner.hardware.
"""

from __future__ import annotations

import math
import os
import re
import reprlib
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml

from planner.errors import UsageError, close_matches, did_you_mean
from planner.resources import hardware_profiles_dir

GB = 1e9  # bytes in a (decimal) GB
GIB = 2**30  # bytes in a GiB
ENV_VAR = "PLANNER_HARDWARE_PATH"
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
TOPOLOGIES = ("switch", "pairs", "pcie", "mesh")
SCHEMA_VERSION = 1

_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# Default size curves, used by profiles that do not give their own (efficiency.matmul_size_scale /
# efficiency.memory_size_scale). Large-GEMM ceiling scaled by op size, after Calculon's a100_80g.json matrix
# "gflops_efficiency" [[128, 0.95], [16, 0.9], [1, 0.6], [0, 0.1]]
# (https://github.com/calculon-ai/calculon/blob/main/systems/a100_80g.json), divided by its 0.95 ceiling; its
# 0-GFLOP tier is placed at 1 MFLOP and the points are joined linearly in log(FLOPs), so time still grows with FLOPs.
MATMUL_SIZE_SCALE = ((1e6, 0.1 / 0.95), (1e9, 0.6 / 0.95), (16e9, 0.9 / 0.95), (128e9, 1.0))
# Transfer-size scale of memory-bound operators, after Calculon's a100_80g.json "mem1" "MB_efficiency"
# [[100, 0.90], [10, 0.75], [1, 0.6], [0, 0.3]] (same source), divided by its 0.90 ceiling and joined linearly in
# log(bytes) (the 0 MB tier placed at 64 KiB): small transfers cannot saturate HBM.
MEMORY_SIZE_SCALE = ((64e3, 0.3 / 0.9), (1e6, 0.6 / 0.9), (10e6, 0.75 / 0.9), (100e6, 1.0))

# --------------------------------------------------------------------------- profiles


class FrozenDict(dict[Any, Any]):
    """A read-only dict: hashable by content, picklable and deep-copyable."""

    def _read_only(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("this mapping is read-only")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _read_only

    def __reduce__(self) -> tuple[type[FrozenDict], tuple[dict[Any, Any]]]:
        return (type(self), (dict(self),))

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator model, loaded from ``hardware_profiles/<key>.yaml``.

    Bandwidths are bytes/s per direction, latencies seconds, FLOP/s dense.
    ``intra_bandwidth`` is the fast link a GPU uses to reach a peer in its node:
    for ``switch`` any peer at that rate; for ``pairs`` only GPU 2k <-> 2k+1
    (others use ``pcie_bandwidth``); for ``pcie`` every peer; for ``mesh`` one
    direct link per peer (a collective over n GPUs uses n-1 links at once).
    """

    key: str
    name: str
    aliases: tuple[str, ...]
    memory_bytes: int
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    intra_topology: str
    intra_bandwidth: float
    pcie_bandwidth: float
    inter_bandwidth: float
    intra_latency: float
    inter_latency: float
    gpus_per_node: int
    matmul_efficiency: float
    memory_efficiency: float
    allreduce_efficiency_intra: float
    allreduce_efficiency_inter: float
    sources: Mapping[str, str]
    path: str
    measured_at_runtime: bool = False
    marketed_memory_gib: float = 0.0  # the vendor's capacity figure (GiB); memory_bytes is what is usable
    inter_fabric: str = ""  # free text, e.g. "8x ConnectX-6 HDR 200Gb/s (DGX A100)"
    #: (FLOPs of one matmul, fraction of matmul_efficiency it reaches), joined linearly in log(FLOPs)
    matmul_size_scale: tuple[tuple[float, float], ...] = ()
    #: (bytes one memory-bound operator moves, fraction of memory_efficiency it reaches), likewise
    memory_size_scale: tuple[tuple[float, float], ...] = ()
    #: FP8 GEMMs: large-GEMM fraction of the fp8 peak and its size curve (0 / empty: matmul_efficiency and its curve)
    matmul_fp8_efficiency: float = 0.0
    matmul_fp8_size_scale: tuple[tuple[float, float], ...] = ()
    #: fraction of the matmul rates above (short-loop GEMM measurements) the device holds through a training step, whose
    #: back-to-back GEMMs run at the clock its power limit allows (1: the measured rates)
    sustained_matmul: float = 1.0
    #: least seconds one operator (kernel) takes in an eager training step: back-to-back kernel issue (profile fixed_costs)
    kernel_floor_s: float = 0.0
    #: seconds of synchronisation each pipeline send/recv adds besides its link latency (profile fixed_costs)
    p2p_sync_s: float = 0.0
    #: bytes/s one NCCL send/recv reaches between two GPUs of a node (intra_node.p2p_gbps: NCCL gives point-to-point
    #: transfers fewer channels than collectives); 0: the link's ``intra_bandwidth``
    intra_p2p_bandwidth: float = 0.0
    #: seconds the host takes to issue one operator of an eager step (framework dispatch and kernel launch; profile
    #: fixed_costs.host_us): a pass takes at least its operators x this (planner.solve.timing.host_bound)
    host_op_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.matmul_size_scale:
            object.__setattr__(self, "matmul_size_scale", MATMUL_SIZE_SCALE)
        if not self.memory_size_scale:
            object.__setattr__(self, "memory_size_scale", MEMORY_SIZE_SCALE)

    def flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` ("bf16", "torch.bfloat16", "float32", ...)."""
        key = normalize_dtype(dtype)
        if key not in self.peak_flops:
            have = ", ".join(self.peak_flops) or "none"
            raise UsageError(
                f"device {self.name} ({self.key}) has no {dtype} peak: its profile lists {have}.",
                hint=f"Pick one of those dtypes, or add peak_tflops.{key} with a source to {self.path}.",
            )
        return self.peak_flops[key]


_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "f32": "fp32",
    "fp32": "fp32",
    "tf32": "tf32",
    "tensorfloat32": "tf32",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "f16": "fp16",
    "fp16": "fp16",
    "fp8": "fp8",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "e4m3": "fp8",
    "e5m2": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
}


def normalize_dtype(dtype: Any) -> str:
    """Map a dtype spelling (``torch.bfloat16``, ``"half"``, ``"bf16"``) to a profile key."""
    if isinstance(dtype, str):
        hit = _NORMALIZED.get(dtype)
        if hit is not None:
            return hit
    s = str(dtype).strip().lower()
    if s.startswith("torch."):
        s = s[len("torch.") :]
    key = _DTYPE_ALIASES.get(s, s)
    if isinstance(dtype, str) and len(_NORMALIZED) < 1024:
        _NORMALIZED[dtype] = key
    return key


#: normalize_dtype's answers by spelling (the time model asks millions of times for a handful of spellings)
_NORMALIZED: dict[str, str] = {}


# ------------------------------------------------------------------ schema check

# field -> (kind, unit/description). Kinds: see _check_value.
_TOP = {
    "schema": ("schema", "the schema version 1"),
    "name": ("str", "the device's full name (text)"),
    "aliases": ("str_list", "a list of other names (text)"),
    "memory_gib": ("pos", "the marketed capacity in GiB"),
    "usable_memory_bytes": ("pos_int", "the allocatable device memory in bytes (a whole number)"),
    "peak_tflops": ("dtype_map", "dense TFLOP/s per dtype, e.g. {bf16: 312}"),
    "memory_bandwidth_gbps": ("pos", "the memory bandwidth in GB/s (decimal)"),
    "intra_node": ("intra", "a mapping {topology, bandwidth_gbps_per_direction, latency_us}"),
    "pcie_gbps_per_direction": ("pos", "the PCIe x16 bandwidth in GB/s per direction"),
    "inter_node": ("inter", "a mapping {bandwidth_gbps_per_direction, latency_us, fabric}"),
    "gpus_per_node": ("pos_int", "the usual number of GPUs per node (a whole number)"),
    "efficiency": ("eff", "a mapping {matmul, memory, allreduce_intra, allreduce_inter} of fractions"),
    "sources": ("sources", "a mapping from each numeric field to its source (URL or note)"),
    "measured_at_runtime": ("bool", "true or false"),
    "notes": ("str", "free text"),
    "fixed_costs": ("fixed", "a mapping {kernel_us, p2p_sync_us[, host_us]} of per-operator and per-send fixed costs"),
}
_OPTIONAL = {"measured_at_runtime", "notes", "fixed_costs"}
_SUB = {
    "intra_node": {
        "topology": ("topology", "one of " + ", ".join(TOPOLOGIES)),
        "bandwidth_gbps_per_direction": ("pos", "GB/s per direction to a peer"),
        "latency_us": ("pos", "microseconds per message step"),
        "p2p_gbps": ("pos", "GB/s one NCCL send/recv between two GPUs of a node reaches (default: the link's bandwidth)"),
    },
    "inter_node": {
        "bandwidth_gbps_per_direction": ("pos", "GB/s per GPU per direction"),
        "latency_us": ("pos", "microseconds per message step"),
        "fabric": ("str", "a description of the NICs (text)"),
    },
    "efficiency": {
        "matmul": ("fraction", "the large-GEMM fraction of peak, in (0, 1]"),
        "memory": ("fraction", "the achieved fraction of memory bandwidth, in (0, 1]"),
        "allreduce_intra": ("fraction", "all-reduce busbw / intra-node link bandwidth, in (0, 1]"),
        "allreduce_inter": ("fraction", "all-reduce busbw / inter-node bandwidth, in (0, 1]"),
        "matmul_size_scale": ("curve", "a list of [FLOPs of one matmul, fraction of efficiency.matmul] points"),
        "memory_size_scale": ("curve", "a list of [bytes one operator moves, fraction of efficiency.memory] points"),
        "matmul_fp8": ("fraction", "the large-GEMM fraction of the fp8 peak an FP8 GEMM reaches, in (0, 1]"),
        "matmul_fp8_size_scale": ("curve", "a list of [FLOPs of one FP8 matmul, fraction of efficiency.matmul_fp8] points"),
        "sustained": ("fraction", "the fraction of the matmul rates held through a training step (power-limited clock), in (0, 1]"),
    },
    "fixed_costs": {
        "kernel_us": ("pos", "microseconds: the least time one kernel of an eager training step takes"),
        "p2p_sync_us": ("pos", "microseconds of synchronisation per pipeline send/recv"),
        "host_us": ("pos", "microseconds of host time to issue one operator of an eager training step"),
    },
}
_SUB_OPTIONAL = {"matmul_size_scale", "memory_size_scale", "matmul_fp8", "matmul_fp8_size_scale", "sustained", "host_us", "p2p_gbps"}
# Every numeric field group needs sources[group] (or sources["group.sub"] for each sub-field).
_NUMERIC_GROUPS = (
    "memory_gib",
    "usable_memory_bytes",
    "peak_tflops",
    "memory_bandwidth_gbps",
    "intra_node",
    "pcie_gbps_per_direction",
    "inter_node",
    "gpus_per_node",
    "efficiency",
)
_NUMERIC_SUBS = {
    "peak_tflops": DTYPES,
    "intra_node": ("bandwidth_gbps_per_direction", "latency_us", "p2p_gbps"),
    "inter_node": ("bandwidth_gbps_per_direction", "latency_us"),
    "efficiency": tuple(_SUB["efficiency"]),
}
_UNIT_SUFFIX = re.compile(r"_(gbps|gbs|gb|gib|tbps|tb|mbps|gbit|gbits|bytes|byte|b|us|ms|ns|s|tflops|flops)$")


class _Checker:
    """Schema check of one parsed profile; every failure names the file and the field."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, field: str, problem: str) -> NoReturn:
        raise UsageError(
            f"hardware profile {self.path}: field '{field}' {problem}",
            hint=(
                f"Compare with a bundled profile such as {hardware_profiles_dir() / 'a100-80gb.yaml'}; "
                "units are part of each field name (gib, gbps = GB/s, us) and every number needs a source."
            ),
        )

    def unknown(self, field: str, known: Iterable[str]) -> None:
        known = list(known)
        leaf = field.rsplit(".", 1)[-1]
        hits = close_matches(leaf, known)
        problem = "is not a known field."
        if hits:
            problem += f" Did you mean '{hits[0]}'?"
            if _UNIT_SUFFIX.sub("", leaf) == _UNIT_SUFFIX.sub("", hits[0]) and leaf != hits[0]:
                problem += f" The unit is part of the name: write '{hits[0]}'."
        problem += " Known fields: " + ", ".join(known) + "."
        self.fail(field, problem)

    def value(self, field: str, kind: str, expected: str, v: Any) -> Any:
        got = f"got {type(v).__name__} {_short_repr(v)}"
        is_num = isinstance(v, (int, float)) and not isinstance(v, bool)
        if kind in ("pos", "pos_int", "fraction"):
            if not is_num or not math.isfinite(v):
                self.fail(field, f"must be a number ({expected}), {got}.")
            if kind == "pos_int" and not float(v).is_integer():
                self.fail(field, f"must be a whole number ({expected}), {got}.")
            if v <= 0:
                self.fail(field, f"must be positive ({expected}), {got}.")
            top = _UPPER.get(field.rsplit(".", 1)[-1], MAX_PROFILE_NUMBER)
            if v > top:
                self.fail(field, f"must be at most {top:g} ({expected}), {got}: no device is that large.")
            if kind == "fraction" and v > 1:
                self.fail(field, f"must be a fraction in (0, 1] ({expected}), {got}.")
            return int(v) if kind == "pos_int" else float(v)
        if kind == "str":
            if not isinstance(v, str) or not v.strip():
                self.fail(field, f"must be non-empty text ({expected}), {got}.")
            return v.strip()
        if kind == "bool":
            if not isinstance(v, bool):
                self.fail(field, f"must be true or false, {got}.")
            return v
        if kind == "schema":
            if v != SCHEMA_VERSION or isinstance(v, bool):
                self.fail(field, f"must be {SCHEMA_VERSION} (the only schema this planner reads), {got}.")
            return v
        if kind == "topology":
            if not isinstance(v, str) or v.strip().lower() not in TOPOLOGIES:
                self.fail(field, f"must be {expected}{did_you_mean(str(v), TOPOLOGIES)} ({got}).")
            return v.strip().lower()
        if kind == "str_list":
            if not isinstance(v, list) or not all(isinstance(a, (str, int)) and str(a).strip() for a in v):
                self.fail(field, f"must be {expected}, {got}.")
            return tuple(str(a).strip() for a in v)
        if kind == "dtype_map":
            m = self.mapping(field, expected, v)
            if not m:
                self.fail(field, f"must list at least one dtype ({expected}).")
            out = {}
            for k, x in m.items():
                if k not in DTYPES:
                    self.unknown(f"{field}.{k}", DTYPES)
                out[k] = self.value(f"{field}.{k}", "pos", "dense TFLOP/s", x)
            return out
        if kind in ("intra", "inter", "eff", "fixed"):
            sub = _SUB[field]
            m = self.mapping(field, expected, v)
            for k in m:
                if k not in sub:
                    self.unknown(f"{field}.{k}", sub)
            out = {}
            for k, (sk, sexp) in sub.items():
                if k not in m:
                    if k in _SUB_OPTIONAL:
                        continue
                    self.fail(f"{field}.{k}", f"is missing (expected {sexp}).")
                out[k] = self.value(f"{field}.{k}", sk, sexp, m[k])
            return out
        if kind == "curve":
            ok = (
                isinstance(v, list)
                and len(v) >= 2
                and all(
                    isinstance(pt, list)
                    and len(pt) == 2
                    and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in pt)
                    for pt in v
                )
            )
            if not ok or any(a[0] >= b[0] for a, b in zip(v, v[1:])) or any(pt[1] > 1 for pt in v):
                self.fail(field, f"must be {expected}: at least two [size, fraction] pairs, sizes increasing, fractions in (0, 1], {got}.")
            return tuple((float(a), float(b)) for a, b in v)
        if kind == "sources":
            m = self.mapping(field, expected, v)
            for k, x in m.items():
                if not isinstance(x, str) or not x.strip():
                    self.fail(f"{field}.{k}", f"must be non-empty text (a URL or a note), got {type(x).__name__} {_short_repr(x)}.")
            return dict(m)
        raise AssertionError(kind)  # pragma: no cover

    def mapping(self, field: str, expected: str, v: Any) -> dict[str, Any]:
        if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
            self.fail(field, f"must be {expected}, got {type(v).__name__} {_short_repr(v)}.")
        return v

    def sources(self, data: dict[str, Any], sources: dict[str, Any]) -> None:
        valid = set(_NUMERIC_GROUPS) | {f"{g}.{s}" for g, subs in _NUMERIC_SUBS.items() for s in subs} | {"fixed_costs"}
        if "fixed_costs" in data and "fixed_costs" not in sources:
            self.fail("sources.fixed_costs", "is missing: 'fixed_costs' holds numbers, and every number needs a source.")
        for k in sources:
            if k not in valid:
                self.unknown(f"sources.{k}", sorted(valid))
        for group in _NUMERIC_GROUPS:
            if group in sources:
                continue
            subs = _NUMERIC_SUBS.get(group)
            present = [s for s in (subs or ()) if s in (data.get(group) or {})]
            if subs and present and all(f"{group}.{s}" in sources for s in present):
                continue
            self.fail(
                f"sources.{group}",
                f"is missing: '{group}' holds numbers, and every number needs a source (a URL, or a note saying it is derived or assumed and how).",
            )


#: largest number any profile field may hold (in the field's own unit), and tighter bounds by field name
MAX_PROFILE_NUMBER = 1e7
_UPPER = {
    "usable_memory_bytes": 2.0**50,
    "memory_gib": 2.0**20,
    "gpus_per_node": 4096,
    "bf16": 1e5,
    "fp16": 1e5,
    "fp32": 1e5,
    "tf32": 1e5,
    "fp8": 1e5,
    "fp64": 1e5,
    "int8": 1e5,  # TFLOP/s
}
#: largest profile file read (bytes) and deepest nesting of its YAML
MAX_PROFILE_BYTES = 1 << 20
MAX_YAML_DEPTH = 20


def _short_repr(v: Any, limit: int = 120) -> str:
    """``repr(v)`` cut to ``limit`` characters (a hostile value must not make the message huge)."""
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother = 3, limit, limit
    text = r.repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_yaml_shape(text: str, path: Path) -> None:
    """Refuse aliases (a profile needs none; they allow exponential 'billion laughs' expansion) and deep nesting."""
    depth = 0
    try:
        for ev in yaml.parse(text, Loader=_YAML_LOADER):
            if isinstance(ev, yaml.AliasEvent):
                raise UsageError(
                    f"hardware profile {path} uses a YAML alias (*name); profiles must spell every value out.",
                    hint="Replace the alias with the value it refers to.",
                )
            if isinstance(ev, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    raise UsageError(
                        f"hardware profile {path} nests deeper than {MAX_YAML_DEPTH} levels.",
                        hint=f"See {hardware_profiles_dir() / 'a100-80gb.yaml'} for the shape of a profile.",
                    )
            elif isinstance(ev, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    except yaml.YAMLError as e:
        raise UsageError(f"hardware profile {path} is not valid YAML: {e}".rstrip(), hint="Fix the YAML syntax (indentation, colons, brackets).") from None


def _read_yaml(path: Path) -> Any:
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"hardware profile {path} is not a regular file.", hint="Point at a *.yaml file or a folder of them.")
        if st.st_size > MAX_PROFILE_BYTES:
            raise UsageError(
                f"hardware profile {path} is {st.st_size:,} bytes; a profile is a few kB (limit {MAX_PROFILE_BYTES:,}).",
                hint="Point at the profile YAML itself.",
            )
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise UsageError(
            f"cannot read hardware profile {path}: {e.strerror or e}.", hint=f"Check the path; bundled profiles are in {hardware_profiles_dir()}."
        ) from None
    except UnicodeDecodeError as e:
        raise UsageError(f"hardware profile {path} is not UTF-8 text ({e.reason} at byte {e.start}).") from None
    _check_yaml_shape(text, path)
    try:
        return yaml.load(text, Loader=_YAML_LOADER)
    except yaml.YAMLError as e:
        raise UsageError(f"hardware profile {path} is not valid YAML: {e}".rstrip(), hint="Fix the YAML syntax (indentation, colons, brackets).") from None


def profile_from_dict(data: Any, path: str | Path) -> DeviceProfile:
    """Check ``data`` (a parsed profile) against the schema and build the profile; key = file stem."""
    path = Path(path)
    c = _Checker(path)
    if not isinstance(data, dict):
        raise UsageError(
            f"hardware profile {path} must be a YAML mapping of fields, got {type(data).__name__}.",
            hint=f"See {hardware_profiles_dir() / 'a100-80gb.yaml'} for a complete example.",
        )
    for k in data:
        if k not in _TOP:
            c.unknown(str(k), _TOP)
    v: dict[str, Any] = {}
    for k, (kind, expected) in _TOP.items():
        if k not in data:
            if k in _OPTIONAL:
                continue
            c.fail(k, f"is missing (expected {expected}).")
        v[k] = c.value(k, kind, expected, data[k])
    c.sources(data, v["sources"])
    cap = v["memory_gib"] * GIB
    if not 0.5 * cap <= v["usable_memory_bytes"] <= 1.1 * cap:
        c.fail(
            "usable_memory_bytes",
            f"is {v['usable_memory_bytes']} bytes, not within 50-110% of memory_gib "
            f"({v['memory_gib']:g} GiB = {cap:.0f} bytes): it is in bytes, not GiB or GB.",
        )
    intra, inter, eff = v["intra_node"], v["inter_node"], v["efficiency"]
    return DeviceProfile(
        key=path.stem,
        name=v["name"],
        aliases=v["aliases"],
        memory_bytes=v["usable_memory_bytes"],
        peak_flops=FrozenDict({k: t * 1e12 for k, t in v["peak_tflops"].items()}),
        memory_bandwidth=v["memory_bandwidth_gbps"] * GB,
        intra_topology=intra["topology"],
        intra_bandwidth=intra["bandwidth_gbps_per_direction"] * GB,
        pcie_bandwidth=v["pcie_gbps_per_direction"] * GB,
        inter_bandwidth=inter["bandwidth_gbps_per_direction"] * GB,
        intra_latency=intra["latency_us"] * 1e-6,
        inter_latency=inter["latency_us"] * 1e-6,
        gpus_per_node=v["gpus_per_node"],
        matmul_efficiency=eff["matmul"],
        memory_efficiency=eff["memory"],
        allreduce_efficiency_intra=eff["allreduce_intra"],
        allreduce_efficiency_inter=eff["allreduce_inter"],
        sources=FrozenDict(v["sources"]),
        path=str(path),
        measured_at_runtime=v.get("measured_at_runtime", False),
        marketed_memory_gib=v["memory_gib"],
        inter_fabric=inter["fabric"],
        matmul_size_scale=eff.get("matmul_size_scale", ()),
        memory_size_scale=eff.get("memory_size_scale", ()),
        matmul_fp8_efficiency=eff.get("matmul_fp8", 0.0),
        matmul_fp8_size_scale=eff.get("matmul_fp8_size_scale", ()),
        sustained_matmul=eff.get("sustained", 1.0),
        intra_p2p_bandwidth=intra.get("p2p_gbps", 0.0) * GB,
        kernel_floor_s=v.get("fixed_costs", {}).get("kernel_us", 0.0) * 1e-6,
        p2p_sync_s=v.get("fixed_costs", {}).get("p2p_sync_us", 0.0) * 1e-6,
        host_op_s=v.get("fixed_costs", {}).get("host_us", 0.0) * 1e-6,
    )


_CACHE: dict[str, tuple[tuple[int, int], DeviceProfile]] = {}


def load_profile(path: str | os.PathLike[str]) -> DeviceProfile:
    """Load and schema-check one profile YAML (cached by path, mtime and size)."""
    path = Path(path)
    try:
        st = path.stat()
        stamp = (st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = None
    hit = _CACHE.get(str(path))
    if stamp is not None and hit is not None and hit[0] == stamp:
        return hit[1]
    profile = profile_from_dict(_read_yaml(path), path)
    if stamp is not None:
        _CACHE[str(path)] = (stamp, profile)
    return profile


def _folder_files(folder: Path) -> tuple[list[Path], list[str]]:
    """The regular ``*.yaml``/``*.yml`` files of ``folder`` (symlinks followed once), and a note per entry skipped
    (a FIFO, a device, a folder, a dangling link or a symlink loop is never opened)."""
    files: list[Path] = []
    notes: list[str] = []
    for p in sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")]):
        try:
            st = p.stat()
        except OSError as e:
            notes.append(f"skipped {p}: {e.strerror or e} (a dangling link or a symlink loop)")
            continue
        if not stat.S_ISREG(st.st_mode):
            notes.append(f"skipped {p}: not a regular file")
            continue
        files.append(p)
    return files, notes


def profile_scan_notes(extra_paths: Sequence[str | os.PathLike[str]] = ()) -> list[str]:
    """Notes on the entries of the profile folders that :func:`available_profiles` skipped."""
    notes: list[str] = []
    for entry, _ in _profile_entries(extra_paths):
        if entry.is_dir():
            notes += _folder_files(entry)[1]
    return notes


def _profile_files(entry: Path, origin: str) -> list[Path]:
    if entry.is_dir():
        return _folder_files(entry)[0]
    if entry.exists():
        return [entry]
    raise UsageError(
        f"hardware profile path {entry} ({origin}) does not exist.",
        hint=f"Point {ENV_VAR} or the extra path at a folder of *.yaml profiles or at one profile file.",
    )


def _profile_entries(extra_paths: Sequence[str | os.PathLike[str]]) -> list[tuple[Path, str]]:
    entries: list[tuple[Path, str]] = [(hardware_profiles_dir(), "bundled profiles")]
    for part in os.environ.get(ENV_VAR, "").split(os.pathsep):
        if part.strip():
            entries.append((Path(part.strip()).expanduser(), f"from ${ENV_VAR}"))
    entries += [(Path(p).expanduser(), "extra path") for p in extra_paths]
    return entries


def available_profiles(extra_paths: Sequence[str | os.PathLike[str]] = ()) -> dict[str, DeviceProfile]:
    """All profiles by key: bundled, then ``$PLANNER_HARDWARE_PATH`` folders (os.pathsep-separated),
    then ``extra_paths`` (files or folders). Later entries override earlier ones with the same key."""
    out: dict[str, DeviceProfile] = {}
    for entry, origin in _profile_entries(extra_paths):
        for f in _profile_files(entry, origin):
            p = load_profile(f)
            out[p.key] = p
    return dict(sorted(out.items()))


# ------------------------------------------------------------------ name resolution

# Short names that cover several parts: which profile they mean, and the note saying so.
AMBIGUOUS_DEFAULTS = {
    "a100": ("a100-80gb", "A100 means A100 SXM4 80GB here; write A100-40GB for the 40 GB part or A100-PCIe for the PCIe card."),
    "h100": ("h100-sxm", "H100 means H100 SXM5 80GB here; write H100-PCIe for the PCIe card."),
    "v100": ("v100-32gb", "V100 means V100 SXM2 32GB here; write V100-16GB for the 16 GB part."),
}
# Notes shown whenever a profile is chosen, for counting conventions that surprise.
DEVICE_NOTES = {
    "mi250x": "MI250X counts GCDs here: each card is 2 devices, so 8xMI250X is 4 cards in one node.",
}
_VENDOR_WORDS = re.compile(r"\b(nvidia|amd|tesla|geforce|instinct)\b")


def _norm(name: str) -> str:
    """Lower-case, drop vendor words, spaces, hyphens and underscores: 'NVIDIA A100-SXM4-80GB' -> 'a100sxm480gb'."""
    s = _VENDOR_WORDS.sub(" ", str(name).lower())
    return re.sub(r"[\s_\-]+", "", s)


def _names(p: DeviceProfile) -> set[str]:
    return {_norm(n) for n in (p.name, *p.aliases)} - {""}


def resolve_device(name: str, profiles: Mapping[str, DeviceProfile] | None = None) -> tuple[DeviceProfile, str | None]:
    """Find a profile by key, name or alias (case-, space- and hyphen-insensitive).

    Returns ``(profile, note)``; ``note`` explains which part an ambiguous short
    name such as "A100" was taken to mean, else ``None``.
    """
    profiles = available_profiles() if profiles is None else profiles
    wanted = _norm(name)
    if not wanted:
        raise UsageError("empty device name.", hint="Write a device such as A100-80GB; `planner hardware list` shows them all.")
    for key, p in profiles.items():
        if _norm(key) == wanted:
            return p, DEVICE_NOTES.get(key)
    matches = sorted(key for key, p in profiles.items() if wanted in _names(p))
    if len(matches) == 1:
        return profiles[matches[0]], DEVICE_NOTES.get(matches[0])
    if wanted in AMBIGUOUS_DEFAULTS and AMBIGUOUS_DEFAULTS[wanted][0] in profiles:
        key, note = AMBIGUOUS_DEFAULTS[wanted]
        return profiles[key], note
    if matches:
        raise UsageError(
            f"device name {name!r} matches several profiles: {', '.join(matches)}.", hint="Write the profile key instead, e.g. " + matches[0] + "."
        )
    candidates = sorted({*profiles, *(n for p in profiles.values() for n in (p.name, *p.aliases))})
    close = close_matches(name, candidates, n=5)
    suggestion = (" Closest names: " + ", ".join(repr(c) for c in close) + ".") if close else ""
    raise UsageError(
        f"unknown device {name!r}.{suggestion} Known devices: {', '.join(profiles)}.",
        hint=f"`planner hardware list` shows every profile; add your own YAML in a folder on ${ENV_VAR}.",
    )
