"""Device profiles, cluster specs (``--gpus``) and the analytical time model.

Torch-free. Internal units are SI: bytes, seconds, FLOP/s and bytes/s. The
profile YAML files put their units in the field names instead: ``*_gib`` is
GiB (2**30 bytes), ``*_gbps`` is GB/s (10**9 bytes/s, decimal, as vendors quote
memory and link bandwidth), ``*_us`` is microseconds, ``peak_tflops`` is dense
TFLOP/s (no 2:4 sparsity). The one exception is the ``--inter-node-gbps`` flag,
which is in Gb/s (gigabits, as NICs are quoted): 200 means 25 GB/s per GPU.

Collective costs follow the NCCL "bus bandwidth" convention (nccl-tests
PERFORMANCE.md; hardware.md section 3a): an all-reduce of ``S`` bytes over
``n`` ranks moves ``2(n-1)/n * S`` bytes through each rank's slowest link, so

    allreduce_time      = 2(n-1)/n * S / busbw + 2(n-1) * latency
    reduce_scatter_time =  (n-1)/n * S / busbw +  (n-1) * latency   (same for all_gather)

with ``S`` the full, unsharded buffer and ``busbw`` the link bandwidth of the
slowest tier the ranks span times that tier's measured efficiency (see
:meth:`Cluster.bus_bandwidth`).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

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

# --------------------------------------------------------------------------- profiles


class FrozenDict(dict):
    """A read-only dict: hashable by content, picklable and deep-copyable."""

    def _read_only(self, *args, **kwargs):
        raise TypeError("this mapping is read-only")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _read_only

    def __reduce__(self):
        return (type(self), (dict(self),))

    def __hash__(self) -> int:
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
    "float32": "fp32", "float": "fp32", "f32": "fp32", "fp32": "fp32",
    "tf32": "tf32", "tensorfloat32": "tf32",
    "bfloat16": "bf16", "bf16": "bf16",
    "float16": "fp16", "half": "fp16", "f16": "fp16", "fp16": "fp16",
    "fp8": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
    "e4m3": "fp8", "e5m2": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8",
}


def normalize_dtype(dtype: Any) -> str:
    """Map a dtype spelling (``torch.bfloat16``, ``"half"``, ``"bf16"``) to a profile key."""
    s = str(dtype).strip().lower()
    if s.startswith("torch."):
        s = s[len("torch."):]
    return _DTYPE_ALIASES.get(s, s)


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
}
_OPTIONAL = {"measured_at_runtime", "notes"}
_SUB = {
    "intra_node": {
        "topology": ("topology", "one of " + ", ".join(TOPOLOGIES)),
        "bandwidth_gbps_per_direction": ("pos", "GB/s per direction to a peer"),
        "latency_us": ("pos", "microseconds per message step"),
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
    },
}
# Every numeric field group needs sources[group] (or sources["group.sub"] for each sub-field).
_NUMERIC_GROUPS = (
    "memory_gib", "usable_memory_bytes", "peak_tflops", "memory_bandwidth_gbps", "intra_node",
    "pcie_gbps_per_direction", "inter_node", "gpus_per_node", "efficiency",
)
_NUMERIC_SUBS = {
    "peak_tflops": DTYPES,
    "intra_node": ("bandwidth_gbps_per_direction", "latency_us"),
    "inter_node": ("bandwidth_gbps_per_direction", "latency_us"),
    "efficiency": tuple(_SUB["efficiency"]),
}
_UNIT_SUFFIX = re.compile(r"_(gbps|gbs|gb|gib|tbps|tb|mbps|gbit|gbits|bytes|byte|b|us|ms|ns|s|tflops|flops)$")


class _Checker:
    """Schema check of one parsed profile; every failure names the file and the field."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, field: str, problem: str) -> None:
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
        got = f"got {type(v).__name__} {v!r}"
        is_num = isinstance(v, (int, float)) and not isinstance(v, bool)
        if kind in ("pos", "pos_int", "fraction"):
            if not is_num or not math.isfinite(v):
                self.fail(field, f"must be a number ({expected}), {got}.")
            if kind == "pos_int" and not float(v).is_integer():
                self.fail(field, f"must be a whole number ({expected}), {got}.")
            if v <= 0:
                self.fail(field, f"must be positive ({expected}), {got}.")
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
        if kind in ("intra", "inter", "eff"):
            sub = _SUB[field]
            m = self.mapping(field, expected, v)
            for k in m:
                if k not in sub:
                    self.unknown(f"{field}.{k}", sub)
            out = {}
            for k, (sk, sexp) in sub.items():
                if k not in m:
                    self.fail(f"{field}.{k}", f"is missing (expected {sexp}).")
                out[k] = self.value(f"{field}.{k}", sk, sexp, m[k])
            return out
        if kind == "sources":
            m = self.mapping(field, expected, v)
            for k, x in m.items():
                if not isinstance(x, str) or not x.strip():
                    self.fail(f"{field}.{k}", f"must be non-empty text (a URL or a note), got {type(x).__name__} {x!r}.")
            return dict(m)
        raise AssertionError(kind)  # pragma: no cover

    def mapping(self, field: str, expected: str, v: Any) -> dict:
        if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
            self.fail(field, f"must be {expected}, got {type(v).__name__} {v!r}.")
        return v

    def sources(self, data: dict, sources: dict) -> None:
        valid = set(_NUMERIC_GROUPS) | {f"{g}.{s}" for g, subs in _NUMERIC_SUBS.items() for s in subs}
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
                f"is missing: '{group}' holds numbers, and every number needs a source "
                "(a URL, or a note saying it is derived or assumed and how).",
            )


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read hardware profile {path}: {e.strerror or e}.",
                         hint=f"Check the path; bundled profiles are in {hardware_profiles_dir()}.") from None
    try:
        return yaml.load(text, Loader=_YAML_LOADER)
    except yaml.YAMLError as e:
        raise UsageError(f"hardware profile {path} is not valid YAML: {e}".rstrip(),
                         hint="Fix the YAML syntax (indentation, colons, brackets).") from None


def profile_from_dict(data: Any, path: str | Path) -> DeviceProfile:
    """Check ``data`` (a parsed profile) against the schema and build the profile; key = file stem."""
    path = Path(path)
    c = _Checker(path)
    if not isinstance(data, dict):
        raise UsageError(f"hardware profile {path} must be a YAML mapping of fields, got {type(data).__name__}.",
                         hint=f"See {hardware_profiles_dir() / 'a100-80gb.yaml'} for a complete example.")
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
        c.fail("usable_memory_bytes",
               f"is {v['usable_memory_bytes']} bytes, not within 50-110% of memory_gib "
               f"({v['memory_gib']:g} GiB = {cap:.0f} bytes): it is in bytes, not GiB or GB.")
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
    )


_CACHE: dict[str, tuple[tuple[int, int], DeviceProfile]] = {}


def load_profile(path: str | os.PathLike) -> DeviceProfile:
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


def _profile_files(entry: Path, origin: str) -> list[Path]:
    if entry.is_dir():
        return sorted([*entry.glob("*.yaml"), *entry.glob("*.yml")])
    if entry.is_file():
        return [entry]
    raise UsageError(f"hardware profile path {entry} ({origin}) does not exist.",
                     hint=f"Point {ENV_VAR} or the extra path at a folder of *.yaml profiles or at one profile file.")


def available_profiles(extra_paths: Sequence[str | os.PathLike] = ()) -> dict[str, DeviceProfile]:
    """All profiles by key: bundled, then ``$PLANNER_HARDWARE_PATH`` folders (os.pathsep-separated),
    then ``extra_paths`` (files or folders). Later entries override earlier ones with the same key."""
    entries: list[tuple[Path, str]] = [(hardware_profiles_dir(), "bundled profiles")]
    for part in os.environ.get(ENV_VAR, "").split(os.pathsep):
        if part.strip():
            entries.append((Path(part.strip()).expanduser(), f"from ${ENV_VAR}"))
    entries += [(Path(p).expanduser(), "extra path") for p in extra_paths]
    out: dict[str, DeviceProfile] = {}
    for entry, origin in entries:
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
        raise UsageError(f"device name {name!r} matches several profiles: {', '.join(matches)}.",
                         hint="Write the profile key instead, e.g. " + matches[0] + ".")
    candidates = sorted({*profiles, *(n for p in profiles.values() for n in (p.name, *p.aliases))})
    close = close_matches(name, candidates, n=5)
    suggestion = (" Closest names: " + ", ".join(repr(c) for c in close) + ".") if close else ""
    raise UsageError(
        f"unknown device {name!r}.{suggestion} Known devices: {', '.join(profiles)}.",
        hint=f"`planner hardware list` shows every profile; add your own YAML in a folder on ${ENV_VAR}.",
    )


# ------------------------------------------------------------------ clusters


@dataclass(frozen=True)
class NodeGroup:
    """``nodes`` nodes of ``gpus_per_node`` identical devices; ``inter_bandwidth`` is bytes/s per GPU per direction."""

    device: DeviceProfile
    nodes: int
    gpus_per_node: int
    inter_bandwidth: float

    @property
    def size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Cluster:
    """Ranks fill node 0 first, then node 1, ...; groups follow each other in ``--gpus`` order."""

    groups: tuple[NodeGroup, ...]
    spec: str
    notes: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.groups:
            raise ValueError("a cluster needs at least one node group")

    @property
    def world_size(self) -> int:
        return sum(g.size for g in self.groups)

    @property
    def num_nodes(self) -> int:
        return sum(g.nodes for g in self.groups)

    @property
    def homogeneous(self) -> bool:
        """True when every node has the same device, GPU count and inter-node bandwidth."""
        return len({(g.device.key, g.gpus_per_node, g.inter_bandwidth) for g in self.groups}) == 1

    @cached_property
    def _starts(self) -> tuple[tuple[int, int], ...]:
        """(first rank, first node) of each group."""
        out, rank, node = [], 0, 0
        for g in self.groups:
            out.append((rank, node))
            rank += g.size
            node += g.nodes
        return tuple(out)

    def _locate(self, rank: int) -> tuple[NodeGroup, int, int]:
        """(group, global node, local index within the node) of ``rank``."""
        if not 0 <= rank < self.world_size or isinstance(rank, bool):
            raise ValueError(f"rank {rank} is outside this {self.world_size}-GPU cluster")
        for g, (r0, n0) in zip(self.groups, self._starts):
            if rank < r0 + g.size:
                off = rank - r0
                return g, n0 + off // g.gpus_per_node, off % g.gpus_per_node
        raise AssertionError("unreachable")  # pragma: no cover

    def device_of(self, rank: int) -> DeviceProfile:
        return self._locate(rank)[0].device

    def node_of(self, rank: int) -> int:
        return self._locate(rank)[1]

    def gpus_per_node_of(self, rank: int) -> int:
        return self._locate(rank)[0].gpus_per_node

    def ranks_of_node(self, node: int) -> range:
        for g, (r0, n0) in zip(self.groups, self._starts):
            if n0 <= node < n0 + g.nodes:
                first = r0 + (node - n0) * g.gpus_per_node
                return range(first, first + g.gpus_per_node)
        raise ValueError(f"node {node} is outside this {self.num_nodes}-node cluster")

    @staticmethod
    def _intra_link(dev: DeviceProfile, la: int, lb: int) -> float:
        if dev.intra_topology == "pairs" and la // 2 != lb // 2:
            return dev.pcie_bandwidth
        return dev.intra_bandwidth

    def p2p_bandwidth(self, a: int, b: int) -> float:
        """Line-rate bytes/s from ``a`` to ``b`` (one direction; inf when a == b).

        Same node: the device's fast link (``pairs``: only GPUs 2k and 2k+1, else
        PCIe). Different nodes: the lower of the two ends' per-GPU inter-node bandwidth.
        """
        ga, na, la = self._locate(a)
        gb, nb, lb = self._locate(b)
        if a == b:
            return math.inf
        if na == nb:
            return self._intra_link(ga.device, la, lb)
        return min(ga.inter_bandwidth, gb.inter_bandwidth)

    def p2p_latency(self, a: int, b: int) -> float:
        """Seconds per message from ``a`` to ``b`` (0 when a == b)."""
        ga, na, _ = self._locate(a)
        gb, nb, _ = self._locate(b)
        if a == b:
            return 0.0
        if na == nb:
            return ga.device.intra_latency
        return max(ga.device.inter_latency, gb.device.inter_latency)

    def p2p_time(self, nbytes: float, a: int, b: int) -> float:
        """Seconds to send ``nbytes`` from ``a`` to ``b``: latency + bytes / bandwidth (0 when a == b or no bytes)."""
        _check_bytes(nbytes)
        if a == b or nbytes == 0:
            self._locate(a), self._locate(b)
            return 0.0
        return self.p2p_latency(a, b) + nbytes / self.p2p_bandwidth(a, b)

    def _intra_busbw(self, dev: DeviceProfile, local: Sequence[int]) -> float:
        n = len(local)
        if dev.intra_topology == "mesh":
            link = dev.intra_bandwidth * (n - 1)
        elif dev.intra_topology == "pairs":
            paired = n == 2 and local[0] // 2 == local[1] // 2
            link = dev.intra_bandwidth if paired else dev.pcie_bandwidth
        else:
            link = dev.intra_bandwidth
        return link * dev.allreduce_efficiency_intra

    def bus_bandwidth(self, ranks: Sequence[int]) -> tuple[float, float]:
        """(busbw in bytes/s, latency per ring step in seconds) for a collective over ``ranks``.

        One node: the intra-node link x ``allreduce_efficiency_intra`` (``mesh``:
        n-1 peer links at once; ``pairs``: the bridge only for a bridged pair, else
        PCIe). Several nodes: the inter-node tier, ``k x inter_bandwidth x
        allreduce_efficiency_inter`` with k the group's ranks on that node (NCCL
        runs one ring per GPU, each through its own NIC share, so a node's rings
        use k NIC shares; with one rank per node this is the plain per-GPU
        bandwidth), taking the slowest node, and never above the intra-node tier of
        any node's subset. Latency is the slowest tier's.
        """
        by_node: dict[int, tuple[NodeGroup, list[int]]] = {}
        for r in sorted(set(ranks)):
            g, node, local = self._locate(r)
            by_node.setdefault(node, (g, []))[1].append(local)
        if len(by_node) == 1:
            (g, local), = by_node.values()
            if len(local) < 2:
                return math.inf, 0.0
            return self._intra_busbw(g.device, local), g.device.intra_latency
        inter = min(len(local) * g.inter_bandwidth * g.device.allreduce_efficiency_inter
                    for g, local in by_node.values())
        caps = [self._intra_busbw(g.device, local) for g, local in by_node.values() if len(local) > 1]
        latency = max(g.device.inter_latency for g, _ in by_node.values())
        return min([inter, *caps]), latency

    def _collective(self, nbytes: float, ranks: Sequence[int], factor: float) -> float:
        _check_bytes(nbytes)
        n = len(set(ranks))
        if n == 0:
            return 0.0
        busbw, latency = self.bus_bandwidth(ranks)
        if n == 1 or nbytes == 0:
            return 0.0
        return factor * (n - 1) / n * nbytes / busbw + factor * (n - 1) * latency

    def allreduce_time(self, nbytes: float, ranks: Sequence[int]) -> float:
        """Ring all-reduce of an ``nbytes`` buffer: 2(n-1)/n * nbytes / busbw + 2(n-1) * latency (0 for n == 1)."""
        return self._collective(nbytes, ranks, 2.0)

    def reduce_scatter_time(self, nbytes: float, ranks: Sequence[int]) -> float:
        """Ring reduce-scatter of an ``nbytes`` (unsharded) buffer: (n-1)/n * nbytes / busbw + (n-1) * latency."""
        return self._collective(nbytes, ranks, 1.0)

    def all_gather_time(self, nbytes: float, ranks: Sequence[int]) -> float:
        """Ring all-gather producing an ``nbytes`` (unsharded) buffer: (n-1)/n * nbytes / busbw + (n-1) * latency."""
        return self._collective(nbytes, ranks, 1.0)

    def to_dict(self) -> dict:
        """JSON-ready summary for plan.json (bandwidths in bytes/s and GB/s per GPU per direction)."""
        return {
            "spec": self.spec,
            "world_size": self.world_size,
            "num_nodes": self.num_nodes,
            "homogeneous": self.homogeneous,
            "groups": [
                {
                    "device": g.device.key,
                    "name": g.device.name,
                    "nodes": g.nodes,
                    "gpus_per_node": g.gpus_per_node,
                    "inter_node_bandwidth_bytes_per_s": g.inter_bandwidth,
                    "inter_node_gbps_per_gpu": g.inter_bandwidth / GB,
                    "measured_at_runtime": g.device.measured_at_runtime,
                }
                for g in self.groups
            ],
            "notes": list(self.notes),
        }


def _check_bytes(nbytes: float) -> None:
    if not nbytes >= 0:  # also rejects NaN
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")


# ------------------------------------------------------------------ --gpus grammar

GPUS_FORMS = ("8xA100 (8 GPUs in one node), 64xH100 (8 nodes of 8), 4x8xA100-80GB (nodes x GPUs per node), "
              "8xA100+8xV100 (groups of different devices, each on its own nodes), A100 (1 GPU)")
_COUNT = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*[x×]\s*", re.IGNORECASE)


def _gpus_error(spec: str, problem: str, hint: str | None = None) -> UsageError:
    return UsageError(f"--gpus {spec!r}: {problem}", hint=hint or f"Write one of: {GPUS_FORMS}.")


def _parse_count(spec: str, text: str) -> int:
    if "." in text:
        raise _gpus_error(spec, f"counts must be whole numbers, got {text}.")
    value = int(text)
    if value <= 0:
        raise _gpus_error(spec, f"counts must be positive, got {text}.")
    return value


def _split_term(spec: str, term: str) -> tuple[list[int], str]:
    """'4 x 8 x A100' -> ([4, 8], 'A100')."""
    rest, counts = term.strip(), []
    while (m := _COUNT.match(rest)) is not None:
        counts.append(m.group(1))
        rest = rest[m.end():].strip()
    if not term.strip():
        raise _gpus_error(spec, "a group is empty (check for a stray '+').")
    if len(counts) > 2:
        raise _gpus_error(spec, f"{term.strip()!r} has {len(counts)} counts; at most two are allowed (NODESxGPUS_PER_NODExDEVICE).")
    if not rest:
        raise _gpus_error(spec, f"{term.strip()!r} names no device after the count.")
    if rest[0] in "xX×" or re.search(r"[x×]\s*\d+\s*$", rest, re.IGNORECASE) and not counts:
        raise _gpus_error(spec, f"{term.strip()!r} is malformed: the count goes before the device, as in 8xA100.")
    return [_parse_count(spec, c) for c in counts], rest


def parse_gpus(
    spec: str,
    gpus_per_node: int | None = None,
    inter_node_gbps: float | None = None,
    profiles: Mapping[str, DeviceProfile] | None = None,
) -> Cluster:
    """Parse ``--gpus`` into a :class:`Cluster`.

    ``NxDEV``: N GPUs; one node when N <= GPUs per node (the profile's, or
    ``gpus_per_node``), else N / GPUs-per-node nodes, which must divide evenly.
    ``MxNxDEV``: M nodes of N. ``A+B``: groups in order, each on its own nodes.
    ``DEV``: one GPU. ``inter_node_gbps`` is in Gb/s per GPU (NIC line rate
    share), converted to bytes/s as x * 1e9 / 8; it overrides every group's profile value.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise _gpus_error(str(spec or ""), "the GPU spec is empty.")
    if gpus_per_node is not None and (isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node <= 0):
        raise UsageError(f"--gpus-per-node must be a positive whole number, got {gpus_per_node!r}.",
                         hint="For example --gpus-per-node 8.")
    if inter_node_gbps is not None:
        if isinstance(inter_node_gbps, bool) or not isinstance(inter_node_gbps, (int, float)) \
                or not math.isfinite(inter_node_gbps) or inter_node_gbps <= 0:
            raise UsageError(f"--inter-node-gbps must be a positive number of Gb/s per GPU, got {inter_node_gbps!r}.",
                             hint="For example 200 for one HDR InfiniBand NIC per GPU (25 GB/s).")
    profiles = available_profiles() if profiles is None else profiles
    spec = spec.strip()
    groups: list[NodeGroup] = []
    notes: list[str] = []
    for term in spec.split("+"):
        counts, name = _split_term(spec, term)
        try:
            device, note = resolve_device(name, profiles)
        except UsageError as e:
            raise UsageError(f"--gpus {spec!r}: {e.message}", hint=e.hint) from None
        if note and note not in notes:
            notes.append(note)
        if len(counts) == 2:
            nodes, per_node = counts
            if gpus_per_node is not None and gpus_per_node != per_node:
                raise _gpus_error(spec, f"{term.strip()!r} puts {per_node} GPUs in a node but --gpus-per-node says {gpus_per_node}.",
                                  hint="Drop --gpus-per-node or make the two agree.")
        else:
            total = counts[0] if counts else 1
            per_node = gpus_per_node or device.gpus_per_node
            if total <= per_node:
                nodes, per_node = 1, total
            elif total % per_node:
                source = "--gpus-per-node" if gpus_per_node else f"the {device.key} profile's gpus_per_node"
                raise _gpus_error(
                    spec,
                    f"{total} GPUs do not divide evenly into nodes of {per_node} ({source}).",
                    hint=f"Write NODESxGPUS_PER_NODExDEVICE, e.g. {math.ceil(total / per_node)}x{per_node}x{name.strip()} "
                         "or pass --gpus-per-node with a divisor of the count.",
                )
            else:
                nodes = total // per_node
        inter = inter_node_gbps * 1e9 / 8 if inter_node_gbps is not None else device.inter_bandwidth
        groups.append(NodeGroup(device=device, nodes=nodes, gpus_per_node=per_node, inter_bandwidth=inter))
    return Cluster(groups=tuple(groups), spec=spec, notes=tuple(notes))


# ------------------------------------------------------------------ time model

# Large-GEMM ceiling scaled by op size, after Calculon's a100_80g.json matrix
# "gflops_efficiency" [[128, 0.95], [16, 0.9], [1, 0.6], [0, 0.1]]
# (https://github.com/calculon-ai/calculon/blob/main/systems/a100_80g.json),
# divided by its 0.95 ceiling. Its 0-GFLOP tier is placed at 1 MFLOP and the
# points are joined linearly in log(FLOPs), so time still grows with FLOPs.
MATMUL_SIZE_SCALE = ((1e6, 0.1 / 0.95), (1e9, 0.6 / 0.95), (16e9, 0.9 / 0.95), (128e9, 1.0))


def matmul_efficiency_at(flops_per_op: float, device: DeviceProfile) -> float:
    """Fraction of dense peak that one matmul of ``flops_per_op`` FLOPs reaches on ``device``."""
    pts = MATMUL_SIZE_SCALE
    if flops_per_op <= pts[0][0]:
        scale = pts[0][1]
    elif flops_per_op >= pts[-1][0]:
        scale = pts[-1][1]
    else:
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if flops_per_op <= x1:
                t = math.log(flops_per_op / x0) / math.log(x1 / x0)
                scale = y0 + t * (y1 - y0)
                break
    return device.matmul_efficiency * scale


def matmul_time(flops: float, device: DeviceProfile, dtype: str, flops_per_op: float | None = None) -> float:
    """Seconds for ``flops`` FLOPs of matmul: flops / (peak(dtype) * matmul_efficiency_at(op size)).

    ``flops_per_op`` is the size of each matmul when ``flops`` sums several; it defaults to ``flops``.
    """
    if not flops >= 0:
        raise ValueError(f"flops must be >= 0, got {flops!r}")
    if flops == 0:
        return 0.0
    size = flops if flops_per_op is None else flops_per_op
    return flops / (device.flops(dtype) * matmul_efficiency_at(size, device))


# Transfer-size scale of memory-bound operators, after Calculon's a100_80g.json "mem1" "MB_efficiency"
# [[100, 0.90], [10, 0.75], [1, 0.6], [0, 0.3]] (same source as above), divided by its 0.90 ceiling and
# joined linearly in log(bytes) (the 0 MB tier placed at 64 KiB): small transfers cannot saturate HBM.
MEMORY_SIZE_SCALE = ((64e3, 0.3 / 0.9), (1e6, 0.6 / 0.9), (10e6, 0.75 / 0.9), (100e6, 1.0))


def _log_interp(x: float, pts) -> float:
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
    return device.memory_efficiency * _log_interp(bytes_per_op, MEMORY_SIZE_SCALE)


def memory_time(nbytes: float, device: DeviceProfile, bytes_per_op: float | None = None) -> float:
    """Seconds to stream ``nbytes`` through device memory: bytes / (bandwidth * memory efficiency).

    With ``bytes_per_op`` the efficiency is that of operators of that size (small ones reach
    less of the bandwidth); without it, the device's large-transfer efficiency.
    """
    _check_bytes(nbytes)
    eff = device.memory_efficiency if bytes_per_op is None else memory_efficiency_at(bytes_per_op, device)
    return nbytes / (device.memory_bandwidth * eff)


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


def profiles_table_rows(profiles: Mapping[str, DeviceProfile] | Iterable[DeviceProfile]) -> list[dict]:
    """Rows for ``planner hardware list``, sorted by key; units are in the key names.

    ``usable_memory_gib`` is the allocatable memory (GiB), ``bf16_tflops`` the dense
    peak (None when the device has no bf16), bandwidths GB/s per direction.
    """
    items = profiles.values() if isinstance(profiles, Mapping) else profiles
    rows = []
    for p in sorted(items, key=lambda p: p.key):
        bf16 = p.peak_flops.get("bf16")
        rows.append({
            "key": p.key,
            "name": p.name,
            "usable_memory_gib": round(p.memory_bytes / GIB, 1),
            "bf16_tflops": None if bf16 is None else bf16 / 1e12,
            "memory_bandwidth_gbps": p.memory_bandwidth / GB,
            "intra_link": intra_link_text(p),
            "inter_node_gbps_per_gpu": p.inter_bandwidth / GB,
            "gpus_per_node": p.gpus_per_node,
            "measured_at_runtime": p.measured_at_runtime,
        })
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
        ("intra_node.bandwidth_gbps_per_direction", f"{_g(p.intra_bandwidth / GB)} GB/s per direction",
         s("intra_node", "bandwidth_gbps_per_direction")),
        ("intra_node.latency_us", f"{_g(p.intra_latency * 1e6)} us", s("intra_node", "latency_us")),
        ("pcie_gbps_per_direction", f"{_g(p.pcie_bandwidth / GB)} GB/s per direction", s("pcie_gbps_per_direction")),
        ("inter_node.bandwidth_gbps_per_direction",
         f"{_g(p.inter_bandwidth / GB)} GB/s per GPU per direction ({_g(p.inter_bandwidth * 8 / 1e9)} Gb/s)",
         s("inter_node", "bandwidth_gbps_per_direction")),
        ("inter_node.latency_us", f"{_g(p.inter_latency * 1e6)} us", s("inter_node", "latency_us")),
        ("inter_node.fabric", p.inter_fabric or "-", s("inter_node")),
        ("gpus_per_node", str(p.gpus_per_node), s("gpus_per_node")),
        ("efficiency.matmul", f"{p.matmul_efficiency:g} of peak (large GEMMs)", s("efficiency", "matmul")),
        ("efficiency.memory", f"{p.memory_efficiency:g} of bandwidth", s("efficiency", "memory")),
        ("efficiency.allreduce_intra", f"{p.allreduce_efficiency_intra:g} of link (busbw)", s("efficiency", "allreduce_intra")),
        ("efficiency.allreduce_inter", f"{p.allreduce_efficiency_inter:g} of link (busbw)", s("efficiency", "allreduce_inter")),
    ]
    if p.measured_at_runtime:
        rows.append(("measured_at_runtime", "yes: placeholders, replaced by calibration", ""))
    return rows
