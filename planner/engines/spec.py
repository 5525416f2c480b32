"""What binds one engine's wing: its rules and the parts of its folder, declared once (torch-free).

A wing is a package ``planner/engines/<name>/``. Its ``__init__.py`` holds one :class:`EngineSpec`, ``SPEC``, and
imports nothing but its ``rules`` module (the floor the solver's callers read), so the registry stays importable
without torch, jinja2 or the engine itself. Its other parts are modules of fixed names, each on the floor of the
general code that uses it, found through the spec (:meth:`EngineSpec.part`) and never by name comparisons:

========== ================================================================================================ ===========
part       what it holds                                                                                    used by
========== ================================================================================================ ===========
render     ``render(plan, command) -> {relative path: text}``: the engine's files of a plan directory        render
validate   ``FILE_KINDS``, ``classify(path, text)``, ``check(run, ctx, path, kind)``, ``RULES``: validate      check
smoke      ``run(plan, plan_dir, request) -> SmokeResult`` or ``SCRIPT`` + ``ENV``: `planner smoke`           check
logs       ``recognise(lines)``, ``parse(lines, path)``: the engine's training log for `planner calibrate`      check
runner     what the rendered training script imports on the cluster                                         run time
========== ================================================================================================ ===========

A wing that lacks a part says why in :attr:`EngineSpec.lacks`; the conformance kit (tests/engines/) fails for a
part that is neither there nor declared missing.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType

from planner.engines.base import Engine
from planner.errors import UsageError

#: every part a wing can have (module names inside its package), and the names each must define
PARTS = ("render", "validate", "smoke", "logs", "runner")
CONTRACT: dict[str, tuple[tuple[str, ...], ...]] = {
    "render": (("render",),),
    "validate": (("FILE_KINDS", "FILE_WHAT", "RULES", "CHECKS_MEMORY", "classify", "check"),),
    # the generic run (planner.check.smoke) told which script to start, or a run of the wing's own
    "smoke": (("SCRIPT", "ENV_CPU", "PACKAGE"), ("run",)),
    "logs": (("recognise", "parse", "ENGINE_TEXT", "LINE_TEXT", "HINT", "GLOBAL_BATCH_TOLERANCE"),),
    "runner": ((),),
}


@dataclass(frozen=True)
class EngineSpec:
    """One engine: its name, its rules (what the search asks), its package and which parts it has."""

    rules: Engine
    package: str
    #: part -> why this wing has none (each part of PARTS is either a module of the package or named here)
    lacks: Mapping[str, str] = field(default_factory=dict)
    #: the rendered file the engine's training starts from (plan directories are checked to hold it)
    entry_file: str = ""

    @property
    def name(self) -> str:
        return self.rules.name

    def has(self, part: str) -> bool:
        return part not in self.lacks

    def problems(self) -> list[str]:
        """What makes this wing half-built: a part neither there (with the names its contract needs) nor declared
        missing with a reason, or one declared missing that is there after all."""
        out = []
        for part in PARTS:
            found = importlib.util.find_spec(f"{self.package}.{part}") is not None
            if part in self.lacks:
                if not self.lacks[part].strip():
                    out.append(f"{self.name}: {part} is declared missing without a reason")
                if found:
                    out.append(f"{self.name}: {part} is declared missing ({self.lacks[part]}) but {self.package}.{part} exists")
                continue
            if not found:
                out.append(f"{self.name}: no {self.package}.{part}, and the spec does not say why (EngineSpec.lacks)")
                continue
            module = importlib.import_module(f"{self.package}.{part}")
            if not any(all(hasattr(module, n) for n in names) for names in CONTRACT[part]):
                need = " or ".join(", ".join(names) for names in CONTRACT[part])
                out.append(f"{self.name}: {self.package}.{part} lacks {need}")
        unknown = sorted(set(self.lacks) - set(PARTS))
        if unknown:
            out.append(f"{self.name}: lacks names parts that do not exist: {', '.join(unknown)}")
        return out

    def part(self, part: str) -> ModuleType:
        """The wing's module ``part`` (imported on first use); a UsageError saying why when the wing has none."""
        if part not in PARTS:
            raise ValueError(f"no part {part!r} (parts: {', '.join(PARTS)})")
        if part in self.lacks:
            raise UsageError(f"{self.name} has no {part}: {self.lacks[part]}.")
        return importlib.import_module(f"{self.package}.{part}")
