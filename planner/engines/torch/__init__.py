"""The torch engine's wing: ``torch.distributed.pipelining`` schedules run over the planned stages of the user's own
model (rules), the training script (render), the CPU smoke run (smoke) and the stage and schedule code the script
imports (runner)."""

from __future__ import annotations

from planner.engines.spec import EngineSpec
from planner.engines.torch.rules import ENGINE

SPEC = EngineSpec(
    ENGINE,
    __name__,
    lacks={
        "validate": "its files are plan.json and the planner's own training script, which validate checks as the plan (PLAN*, MEM*, drift)",
        "logs": "its script writes the step times calibrate reads from smoke.json (--stats-out), not a log of its own",
    },
    entry_file="train_torch.py",
)
