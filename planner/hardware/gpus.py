"""The ``--gpus`` grammar: ``8xA100``, ``64xH100``, ``4x8xA100-80GB``, ``8xA100+8xV100``."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from planner.errors import UsageError
from planner.hardware.cluster import Cluster, NodeGroup
from planner.hardware.profiles import DeviceProfile, available_profiles, resolve_device

# ------------------------------------------------------------------ --gpus grammar

GPUS_FORMS = (
    "8xA100 (8 GPUs in one node), 64xH100 (8 nodes of 8), 4x8xA100-80GB (nodes x GPUs per node), "
    "8xA100+8xV100 (groups of different devices, each on its own nodes), A100 (1 GPU)"
)
_COUNT = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*[x×]\s*", re.IGNORECASE)


def _gpus_error(spec: str, problem: str, hint: str | None = None) -> UsageError:
    return UsageError(f"--gpus {spec!r}: {problem}", hint=hint or f"Write one of: {GPUS_FORMS}.")


#: the largest cluster the planner plans for (GPUs); the largest training clusters built hold about 10**5
MAX_WORLD_SIZE = 1 << 17


def _parse_count(spec: str, text: str) -> int:
    if "." in text:
        raise _gpus_error(spec, f"counts must be whole numbers, got {text[:20]}.")
    if len(text.lstrip("+-0")) > 9:
        raise _gpus_error(spec, f"the count {text[:20]}{'...' if len(text) > 20 else ''} is too large (at most {MAX_WORLD_SIZE:,} GPUs in all).")
    value = int(text)
    if value <= 0:
        raise _gpus_error(spec, f"counts must be positive, got {text}.")
    return value


def _split_term(spec: str, term: str) -> tuple[list[int], str]:
    """'4 x 8 x A100' -> ([4, 8], 'A100')."""
    rest, counts = term.strip(), []
    while (m := _COUNT.match(rest)) is not None:
        counts.append(m.group(1))
        rest = rest[m.end() :].strip()
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
        raise UsageError(f"--gpus-per-node must be a positive whole number, got {gpus_per_node!r}.", hint="For example --gpus-per-node 8.")
    if inter_node_gbps is not None:
        if isinstance(inter_node_gbps, bool) or not isinstance(inter_node_gbps, (int, float)) or not math.isfinite(inter_node_gbps) or inter_node_gbps <= 0:
            raise UsageError(
                f"--inter-node-gbps must be a positive number of Gb/s per GPU, got {inter_node_gbps!r}.",
                hint="For example 200 for one HDR InfiniBand NIC per GPU (25 GB/s).",
            )
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
                raise _gpus_error(
                    spec,
                    f"{term.strip()!r} puts {per_node} GPUs in a node but --gpus-per-node says {gpus_per_node}.",
                    hint="Drop --gpus-per-node or make the two agree.",
                )
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
    world = sum(g.size for g in groups)
    if world > MAX_WORLD_SIZE:
        raise _gpus_error(
            spec,
            f"{world:,} GPUs is more than the {MAX_WORLD_SIZE:,} the planner plans for.",
            hint="Plan one pipeline-parallel replica group at a time, or a smaller cluster.",
        )
    return Cluster(groups=tuple(groups), spec=spec, notes=tuple(notes))
