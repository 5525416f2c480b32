"""torchtitan's wing: its schedules, FSDP2 state and layout rules (rules), the ``torchtitan.train`` command line
(render)."""

from __future__ import annotations

from planner.engines.spec import EngineSpec
from planner.engines.torchtitan.rules import ENGINE

SPEC = EngineSpec(
    ENGINE,
    __name__,
    lacks={
        "validate": "not built yet: validate checks a torchtitan plan directory's plan.json only",
        "smoke": "not built yet: a torchtitan plan is not run by planner smoke",
        "logs": "not built yet: torchtitan's log lines are not read by calibrate",
        "runner": "torchtitan.train builds and trains its own model; the launch script imports nothing of the planner",
    },
    entry_file="launch_torchtitan.sh",
)
