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

from planner.hardware.cluster import Cluster, NodeGroup
from planner.hardware.describe import describe_profile, intra_link_text, profiles_table_rows
from planner.hardware.device_time import (
    MATMUL_SIZE_SCALE,
    MEMORY_SIZE_SCALE,
    matmul_efficiency_at,
    matmul_time,
    memory_efficiency_at,
    memory_time,
    size_scale,
)
from planner.hardware.gpus import GPUS_FORMS, parse_gpus
from planner.hardware.profiles import (
    DTYPES,
    ENV_VAR,
    GB,
    GIB,
    SCHEMA_VERSION,
    TOPOLOGIES,
    DeviceProfile,
    FrozenDict,
    available_profiles,
    load_profile,
    normalize_dtype,
    profile_from_dict,
    resolve_device,
)

__all__ = [
    "DTYPES",
    "ENV_VAR",
    "GB",
    "GIB",
    "GPUS_FORMS",
    "MATMUL_SIZE_SCALE",
    "MEMORY_SIZE_SCALE",
    "SCHEMA_VERSION",
    "TOPOLOGIES",
    "Cluster",
    "DeviceProfile",
    "FrozenDict",
    "NodeGroup",
    "available_profiles",
    "describe_profile",
    "intra_link_text",
    "load_profile",
    "matmul_efficiency_at",
    "matmul_time",
    "memory_efficiency_at",
    "memory_time",
    "normalize_dtype",
    "parse_gpus",
    "profile_from_dict",
    "profiles_table_rows",
    "resolve_device",
    "size_scale",
]
