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
            "torchtitan.train does not train on CPU: 0.3.0's Trainer takes the accelerator's device module, torch.cuda "
            "when none is found (tools/utils.py get_device_info), and calls its set_device unconditionally (trainer.py), "
            "which a CPU-only torch lacks; its llama3 registry also imports triton kernels. `planner validate` checks the "
            "rendered command line against plan.json, and with torchtitan's own ConfigManager where it imports"
        ),
        "logs": "not built yet: torchtitan's log lines (tps, memory) are not read by planner calibrate",
        "runner": "torchtitan.train builds and trains its own model; the launch script imports nothing of the planner",
    },
    entry_file="launch_torchtitan.sh",
)
