"""How plans refer to the model: a model file path, or a library spec (``hf:CONFIG.json``, ``timm:NAME``,
``torchvision:NAME``). Torch-free, so the renderers can relocate a reference without loading the model."""

from __future__ import annotations

import os
from pathlib import Path

#: spec prefix -> whether the rest of the spec is a filesystem path (hf: names a config file)
SPEC_PREFIXES = {"hf": True, "timm": False, "torchvision": False}


def split_ref(ref: str) -> tuple[str | None, str]:
    """("hf", "cfg.json") for ``hf:cfg.json``; (None, ref) for a model file path."""
    prefix, sep, rest = ref.partition(":")
    if sep and prefix in SPEC_PREFIXES:
        return prefix, rest
    return None, ref


def relative_ref(ref: str, base_dir: str | os.PathLike[str]) -> str:
    """``ref`` with its path (if it has one) made relative to ``base_dir``, in POSIX form: ``hf:cfg.json`` seen
    from ``plans/x`` is ``hf:../../cfg.json``; ``timm:vit_tiny`` is unchanged."""
    prefix, rest = split_ref(ref)
    if prefix is not None and not SPEC_PREFIXES[prefix]:
        return ref
    rel = Path(os.path.relpath(Path(rest).resolve(), Path(base_dir).resolve())).as_posix()
    return f"{prefix}:{rel}" if prefix else rel


def ref_stem(ref: str) -> str:
    """A short name for the model: the file stem, or the library model's name."""
    prefix, rest = split_ref(ref)
    return Path(rest).stem if prefix is None or SPEC_PREFIXES[prefix] else rest


def resolve_ref(ref: str, base_dir: str | os.PathLike[str]) -> str:
    """``ref`` with a relative path (if it has one) resolved against ``base_dir``: an absolute reference."""
    prefix, rest = split_ref(ref)
    if prefix is not None and not SPEC_PREFIXES[prefix]:
        return ref
    path = Path(rest) if Path(rest).is_absolute() else Path(base_dir) / rest
    resolved = path.resolve().as_posix()
    return f"{prefix}:{resolved}" if prefix else resolved


def ref_exists(ref: str) -> bool:
    """Whether the file a reference names exists (library names always do as far as files go)."""
    prefix, rest = split_ref(ref)
    return (prefix is not None and not SPEC_PREFIXES[prefix]) or Path(rest).is_file()


def resolve_recorded(paths: list[str] | tuple[str, ...], plan_dir: str | os.PathLike[str]) -> tuple[str, ...]:
    """File paths a plan.json records (hardware profiles), resolved against the plan directory, where the planner
    records them; a path that is not there is kept as recorded (plans written before paths were made relative named
    them from where `planner plan` ran)."""
    out = []
    for p in paths:
        here = Path(p) if Path(p).is_absolute() else Path(plan_dir) / p
        out.append(here.resolve().as_posix() if here.exists() else str(p))
    return tuple(out)
