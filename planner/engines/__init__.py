"""The training engines: one wing each (planner/engines/<name>/), bound by its EngineSpec (planner.engines.spec).

Adding an engine: a package here whose ``__init__`` defines ``SPEC``, and one line in :data:`ENGINES`. The
conformance kit (tests/engines/test_conformance.py) then checks every part the spec does not declare missing.
"""

from __future__ import annotations

from planner.engines import deepspeed, megatron, torch, torchtitan
from planner.engines.base import Engine
from planner.engines.spec import EngineSpec
from planner.errors import UsageError, did_you_mean

#: the one registry: engine name -> its spec
ENGINES: dict[str, EngineSpec] = {s.name: s for s in (deepspeed.SPEC, megatron.SPEC, torch.SPEC, torchtitan.SPEC)}


def get_spec(name: str) -> EngineSpec:
    """The engine called ``name``; a UsageError naming the known ones otherwise."""
    if name not in ENGINES:
        raise UsageError(f"Unknown engine {name!r}.{did_you_mean(str(name), ENGINES)}", f"Use one of {', '.join(ENGINES)}.")
    return ENGINES[name]


def get_engine(name: str) -> Engine:
    """The rules of the engine called ``name`` (what the search asks)."""
    return get_spec(name).rules


__all__ = ["ENGINES", "Engine", "EngineSpec", "get_engine", "get_spec"]
