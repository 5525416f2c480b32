"""DeepSpeed's wing: pipeline parallelism with ``deepspeed.pipe.PipelineModule`` and ZeRO stage 1 (rules), the
config and training script (render), DeepSpeed's own config checks (validate), the CPU smoke run (smoke), its log
lines (logs) and the pipeline module the scripts import (runner)."""

from __future__ import annotations

from planner.engines.deepspeed.rules import ENGINE
from planner.engines.spec import EngineSpec

SPEC = EngineSpec(
    ENGINE,
    __name__,
    lacks={},
    entry_file="ds_config.json",
)
