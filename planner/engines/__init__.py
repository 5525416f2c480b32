"""The training engines, one module each behind planner.engines.base.Engine.

Adding an engine: a module here with an ``ENGINE`` instance, listed in :data:`ENGINES`,
and its renderer in planner/render/ under the same name.
"""

from __future__ import annotations

from planner.engines import deepspeed, megatron, torchpp, torchtitan
from planner.engines.base import Engine
from planner.errors import UsageError, did_you_mean

ENGINES: dict[str, Engine] = {e.name: e for e in (deepspeed.ENGINE, megatron.ENGINE, torchpp.ENGINE, torchtitan.ENGINE)}


def get_engine(name: str) -> Engine:
    """The engine called ``name``; a UsageError naming the known ones otherwise."""
    if name not in ENGINES:
        raise UsageError(f"Unknown engine {name!r}.{did_you_mean(str(name), ENGINES)}", f"Use one of {', '.join(ENGINES)}.")
    return ENGINES[name]


__all__ = ["ENGINES", "Engine", "get_engine"]
