"""The cluster: node groups of devices, rank placement, point-to-point and collective costs.

Torch-free. Collective costs follow the NCCL bus-bandwidth convention (see planner.hardware).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from planner.hardware.profiles import GB, DeviceProfile

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

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a cluster needs at least one node group")

    @cached_property
    def world_size(self) -> int:
        return sum(g.size for g in self.groups)

    @property
    def num_nodes(self) -> int:
        return sum(g.nodes for g in self.groups)

    @cached_property
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
        if len(self.groups) == 1 and type(rank) is int and 0 <= rank < self.world_size:  # one group: no search
            g = self.groups[0]
            return g, rank // g.gpus_per_node, rank % g.gpus_per_node
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
        """Bytes/s one send from ``a`` to ``b`` reaches (one direction; inf when a == b).

        Same node: the device's fast link (``pairs``: only GPUs 2k and 2k+1, else
        PCIe), capped at what one NCCL send/recv reaches over it where the profile
        gives that (``intra_p2p_bandwidth``). Different nodes: the lower of the two
        ends' per-GPU inter-node bandwidth.
        """
        ga, na, la = self._locate(a)
        gb, nb, lb = self._locate(b)
        if a == b:
            return math.inf
        if na == nb:
            link = self._intra_link(ga.device, la, lb)
            p2p = ga.device.intra_p2p_bandwidth
            return min(link, p2p) if p2p > 0 else link
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

    def _rank_array(self, ranks: Sequence[int] | np.ndarray) -> np.ndarray:
        """``ranks`` as sorted unique int64 (a ``range`` is expanded by numpy, never by a Python loop)."""
        if isinstance(ranks, np.ndarray):
            arr = ranks.astype(np.int64, copy=False)
        elif isinstance(ranks, range):
            arr = np.arange(ranks.start, ranks.stop, ranks.step, dtype=np.int64)
        else:
            arr = np.asarray(list(ranks), dtype=np.int64)
        if arr.size > 1 and not bool(np.all(arr[1:] > arr[:-1])):  # already sorted and unique: the usual case
            arr = np.unique(arr)
        if arr.size and (arr[0] < 0 or arr[-1] >= self.world_size):
            bad = int(arr[0]) if arr[0] < 0 else int(arr[-1])
            raise ValueError(f"rank {bad} is outside this {self.world_size}-GPU cluster")
        return arr

    def _node_members(self, arr: np.ndarray) -> list[tuple[NodeGroup, np.ndarray, np.ndarray]]:
        """Per node group touched: (group, member count of each node touched, local index of each member in
        node order), from the groups' arithmetic rather than rank by rank."""
        out = []
        for g, (r0, _) in zip(self.groups, self._starts):
            lo, hi = np.searchsorted(arr, [r0, r0 + g.size])
            if lo == hi:
                continue
            off = arr[lo:hi] - r0
            node = off // g.gpus_per_node  # sorted
            starts = np.flatnonzero(np.r_[True, node[1:] != node[:-1]])
            counts = np.diff(np.r_[starts, node.size])
            out.append((g, counts, off % g.gpus_per_node))
        return out

    def bus_bandwidth(self, ranks: Sequence[int] | np.ndarray) -> tuple[float, float]:
        """(busbw in bytes/s, latency per ring step in seconds) for a collective over ``ranks``.

        One node: the intra-node link x ``allreduce_efficiency_intra`` (``mesh``:
        n-1 peer links at once; ``pairs``: the bridge only for a bridged pair, else
        PCIe). Several nodes: the inter-node tier, ``k x inter_bandwidth x
        allreduce_efficiency_inter`` with k the group's ranks on that node (NCCL
        runs one ring per GPU, each through its own NIC share, so a node's rings
        use k NIC shares; with one rank per node this is the plain per-GPU
        bandwidth), taking the slowest node, and never above the intra-node tier of
        any node's subset. Latency is the slowest tier's.

        Computed per node group from the members' node and local indices (numpy), so a collective over a
        million ranks costs milliseconds.
        """
        arr = self._rank_array(ranks)
        if arr.size == 0:
            raise ValueError("a collective needs at least one rank")
        members = self._node_members(arr)
        if sum(len(counts) for _, counts, _ in members) == 1:
            g, counts, local = members[0]
            if counts[0] < 2:
                return math.inf, 0.0
            return self._intra_busbw(g.device, [int(x) for x in local]), g.device.intra_latency
        inter = min(float(counts.min()) * g.inter_bandwidth * g.device.allreduce_efficiency_inter for g, counts, _ in members)
        caps = [self._group_intra_cap(g, counts, local) for g, counts, local in members]
        latency = max(g.device.inter_latency for g, _, _ in members)
        return min([inter, *(c for c in caps if c is not None)]), latency

    def _group_intra_cap(self, g: NodeGroup, counts: np.ndarray, local: np.ndarray) -> float | None:
        """The lowest intra-node busbw among this group's nodes holding two or more members (None: none do)."""
        multi = counts[counts > 1]
        if multi.size == 0:
            return None
        dev = g.device
        if dev.intra_topology == "mesh":
            return dev.intra_bandwidth * (int(multi.min()) - 1) * dev.allreduce_efficiency_intra
        if dev.intra_topology == "pairs":
            if (counts > 2).any():
                return dev.pcie_bandwidth * dev.allreduce_efficiency_intra
            ends = np.cumsum(counts)
            pair = counts == 2
            bridged = bool(np.all(local[(ends - counts)[pair]] // 2 == local[(ends - 1)[pair]] // 2))
            return (dev.intra_bandwidth if bridged else dev.pcie_bandwidth) * dev.allreduce_efficiency_intra
        return dev.intra_bandwidth * dev.allreduce_efficiency_intra

    def _collective(self, nbytes: float, ranks: Sequence[int], factor: float) -> float:
        _check_bytes(nbytes)
        arr = self._rank_array(ranks)
        n = int(arr.size)
        if n == 0:
            return 0.0
        busbw, latency = self.bus_bandwidth(arr)
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

    def all_to_all_time(self, nbytes: float, ranks: Sequence[int]) -> float:
        """All-to-all where every rank of ``ranks`` holds ``nbytes`` and sends an equal 1/n of it to each member
        (the expert-parallel dispatch at balanced routing; NCCL runs it as grouped point-to-point sends, all at once).

        A rank with k members on its node sends (k - 1)/n of its bytes over the intra-node link (the device's
        link to those k - 1 peers, at ``allreduce_efficiency_intra``) and (n - k)/n through its own NIC share
        (``inter_bandwidth`` x ``allreduce_efficiency_inter``) at the same time: the slower of the two, for the
        node with the fewest members (the most traffic off the node), plus one message latency of the slowest
        tier used. One node: nbytes x (n - 1)/n / intra-node bandwidth. 0 for one rank or no bytes.
        """
        _check_bytes(nbytes)
        arr = self._rank_array(ranks)
        n = int(arr.size)
        if n <= 1 or nbytes == 0:
            return 0.0
        worst = 0.0
        for g, counts, local in self._node_members(arr):
            dev = g.device
            ends = np.cumsum(counts)
            for k, end in zip(counts.tolist(), ends.tolist()):
                members = [int(x) for x in local[end - k : end]]
                intra = nbytes * (k - 1) / n / self._intra_busbw(dev, members) if k > 1 else 0.0
                inter = nbytes * (n - k) / n / (g.inter_bandwidth * dev.allreduce_efficiency_inter) if n > k else 0.0
                latency = dev.inter_latency if n > k else dev.intra_latency
                worst = max(worst, max(intra, inter) + latency)
        return worst

    def to_dict(self) -> dict[str, Any]:
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
