"""The training engines, one module each behind planner.engines.base.Engine.

Adding an engine: a module here with an ``ENGINE`` instance, listed in :data:`ENGINES`,
and its renderer in planner/render/ under the same name.
"""

from __future__ import annotations

from planner.engines import deepspeed, megatron, torchpp
from planner.engines.base import Engine
from planner.errors import UsageError, did_you_mean

ENGINES: dict[str, Engine] = {e.name: e for e in (deepspeed.ENGINE, megatron.ENGINE, torchpp.ENGINE)}


def get_engine(name: str) -> Engine:
    """The engine called ``name``; a UsageError naming the known ones otherwise."""
    if name not in ENGINES:
        raise UsageError(f"Unknown engine {name!r}.{did_you_mean(str(name), ENGINES)}", f"Use one of {', '.join(ENGINES)}.")
    return ENGINES[name]


def zero_rules(engine: str, zero: int, pp: int) -> list[str]:
    """Why ``engine`` cannot run ZeRO stage ``zero`` with ``pp`` pipeline stages (Engine.zero_problems)."""
    return get_engine(engine).zero_problems(zero, pp)


def schedule_rules(engine: str, schedule: str, pp: int, m: int, v: int) -> list[str]:
    """Why ``engine`` cannot run ``schedule`` with pp ranks, m micro-batches, v stages per rank (Engine.schedule_problems)."""
    return get_engine(engine).schedule_problems(schedule, pp, m, v)


__all__ = ["ENGINES", "Engine", "get_engine", "schedule_rules", "zero_rules"]
