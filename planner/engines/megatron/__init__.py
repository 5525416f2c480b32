"""Megatron-LM's wing: its rules and closed forms (rules, activations, traffic, recompute, architecture, flags,
arg_rules, layout, moe), the launch script (render), its argument validation run on the rendered flags (validate,
script, core_check), the smoke check (smoke) and its log lines (logs)."""

from __future__ import annotations

from planner.engines.megatron.rules import ENGINE
from planner.engines.spec import EngineSpec

SPEC = EngineSpec(
    ENGINE,
    __name__,
    lacks={
        "runner": "pretrain_gpt.py builds and trains the model itself from the rendered flags; the launch script imports nothing of the planner",
    },
    entry_file="pretrain_gpt.sh",
)
