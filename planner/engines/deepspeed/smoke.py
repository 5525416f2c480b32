"""``planner smoke`` of a deepspeed plan: the generic run of planner.check.smoke (the rendered training script under
torchrun on CPU ranks with gloo, or GPUs, against a single-process reference), told which script to start."""

from __future__ import annotations

from planner.engines.deepspeed.render import SCRIPT

#: extra environment of every rank on CPU (DeepSpeed picks its accelerator from DS_ACCELERATOR)
ENV_CPU: dict[str, str] = {"DS_ACCELERATOR": "cpu"}
#: the engine's own library, whose version smoke.json records (None: torch only)
PACKAGE: str | None = "deepspeed"

__all__ = ["ENV_CPU", "PACKAGE", "SCRIPT"]
