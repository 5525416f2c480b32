"""``planner smoke`` of a torch plan: the generic run of planner.check.smoke (the rendered training script under
torchrun on CPU ranks with gloo, or GPUs, against a single-process reference), told which script to start."""

from __future__ import annotations

from planner.engines.torch.render import SCRIPT

#: extra environment of every rank on CPU
ENV_CPU: dict[str, str] = {}
#: the engine's own library, whose version smoke.json records (None: torch only)
PACKAGE: str | None = None

__all__ = ["ENV_CPU", "PACKAGE", "SCRIPT"]
