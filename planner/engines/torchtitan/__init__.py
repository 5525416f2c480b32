"""torchtitan's wing: its schedules, FSDP2 state, activation checkpointing and layout rules (rules, checkpointing),
the ``torchtitan.train`` command line (render) and its check against plan.json (validate)."""

from __future__ import annotations

from planner.engines.spec import EngineSpec
from planner.engines.torchtitan.rules import ENGINE

SPEC = EngineSpec(
    ENGINE,
    __name__,
    lacks={
        "smoke": (
            "torchtitan.train does not start on a CPU-only torch: 0.3.0's llama3 model registry imports its MoE token "
            "dispatcher's triton kernels, and triton ships with CUDA builds of torch only; `planner validate` checks the "
            "rendered command line against plan.json (and with torchtitan's own ConfigManager where it imports)"
        ),
        "logs": "not built yet: torchtitan's log lines (tps, memory) are not read by planner calibrate",
        "runner": "torchtitan.train builds and trains its own model; the launch script imports nothing of the planner",
    },
    entry_file="launch_torchtitan.sh",
)
