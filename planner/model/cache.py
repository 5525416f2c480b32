"""A content-addressed cache of traced and costed models: a second `plan` or `validate` of the same model skips
loading, tracing and costing it.

An entry holds what planning reads of an analysed model (:class:`ModelSummary`: the costs, the tracer used, the model
file's sha256, why an engine derives no shape from its transformers config), under a key made of everything that
decides it without running the model's code:

* the model reference: a file's resolved path and its bytes' sha256 (an ``hf:`` config's likewise); a ``timm:`` or
  ``torchvision:`` name as given;
* the model arguments, the micro-batch costed, the dtype, ``--leaf`` classes, the tracer, sub-block cuts;
* the versions of the planner, Python, and of torch, transformers, timm, torchvision and diffusers where installed.

What the model's analysis reaches beyond its own file is checked on every hit: each local Python file it imported and
each file it opened (outside the interpreter's prefixes: a config its build reads) by sha256, and each installed
distribution it imported by version. A mismatch,
an unreadable entry or a different entry format is a miss. Nothing cached changes a result: a hit returns the costs
the miss computed, through ModelCosts' own JSON form (floats round-trip exactly), and the tests hold plans made with
and without the cache byte-identical.

Where: ``$PLANNER_CACHE_DIR``, else ``$XDG_CACHE_HOME/planner``, else ``~/.cache/planner`` (a folder ``analyses``).
``PLANNER_CACHE=off`` (or ``--no-cache``) neither reads nor writes. Entries are written atomically; the oldest are
removed beyond :data:`MAX_ENTRIES`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner import __version__
from planner.fileio import MAX_INPUT_BYTES, loads_json_bounded
from planner.records import ModelCosts

#: the format of an entry; an entry of another format is a miss
ENTRY_FORMAT = 1
#: entries kept; the least recently written beyond this are removed
MAX_ENTRIES = 64
#: libraries whose installed version is part of every key (a model built from them changes with them)
KEYED_LIBRARIES = ("torch", "transformers", "timm", "torchvision", "diffusers")
LIBRARY_PREFIXES = ("hf:", "timm:", "torchvision:")


@dataclass(frozen=True)
class ModelSummary:
    """What planning reads of an analysed model: its costs (the architecture derived where it is derived), the tracer
    used, the model file's sha256, and for each engine why it derives no shape from the model's transformers config
    (None where it does, or where the model is not built from transformers)."""

    costs: ModelCosts
    tracer: str
    sha256: str
    gaps: dict[str, str | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"costs": self.costs.to_dict(), "tracer": self.tracer, "sha256": self.sha256, "gaps": dict(self.gaps)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSummary:
        return cls(ModelCosts.from_dict(d["costs"]), str(d["tracer"]), str(d["sha256"]), dict(d.get("gaps") or {}))


def enabled() -> bool:
    return os.environ.get("PLANNER_CACHE", "").strip().lower() not in ("off", "0", "false", "no")


def cache_dir() -> Path:
    base = os.environ.get("PLANNER_CACHE_DIR")
    if base:
        return Path(base) / "analyses"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "planner" / "analyses"


def _sha256_file(path: Path) -> str | None:
    h = hashlib.sha256()
    try:
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


_PLANNER_DIGEST: list[str] = []


def planner_digest() -> str:
    """sha256 over the planner's own Python files (an edited checkout is another planner, whatever its version)."""
    if not _PLANNER_DIGEST:
        root = Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        for p in sorted(root.rglob("*.py")):
            h.update(str(p.relative_to(root)).encode())
            h.update((_sha256_file(p) or "").encode())
        _PLANNER_DIGEST.append(h.hexdigest())
    return _PLANNER_DIGEST[0]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cache_key(ref: str, model_args: dict[str, Any], micro_batch: int, dtype: str, leaf: list[str], tracer: str, sub_block_cuts: bool) -> str | None:
    """The key of a model's analysis (see the module docstring); None where the reference names no readable file."""
    prefix, _, rest = ref.partition(":")
    if f"{prefix}:" in LIBRARY_PREFIXES and prefix != "hf":
        source: dict[str, Any] = {"library": ref}
    else:
        path = Path(rest if prefix == "hf" else ref)
        digest = _sha256_file(path) if path.is_file() else None
        if digest is None:
            return None
        source = {"path": str(path.resolve()), "sha256": digest, "hf": prefix == "hf"}
    described = {
        "format": ENTRY_FORMAT,
        "planner": [__version__, planner_digest()],
        "python": platform.python_version(),
        "libraries": {name: _version(name) for name in KEYED_LIBRARIES},
        "source": source,
        "model_args": model_args,
        "micro_batch": micro_batch,
        "dtype": dtype,
        "leaf": sorted(leaf),
        "tracer": tracer,
        "sub_block_cuts": sub_block_cuts,
    }
    try:
        text = json.dumps(described, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()


#: the sets of paths being recorded (imports_recorded): every file opened while one is active is added to each
_OPENED: list[set[str]] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    """sys.addaudithook's callback: the paths ``open`` events name while a recording is active."""
    if event == "open" and _OPENED and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        for found in _OPENED:
            found.add(os.path.abspath(path))


sys.addaudithook(_audit)


#: what an analysis opens that is not the model's: the kernel's and the devices' files (torch reads CPU counts and
#: mounts there; they differ on every boot). Temporary files the planner opens are gone when the analysis ends.
_VOLATILE = ("/proc/", "/sys/", "/dev/")


def _system_prefixes() -> tuple[str, ...]:
    return tuple(sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}))


@contextmanager
def imports_recorded(model: Path | None = None) -> Iterator[dict[str, Any]]:
    """Within the block, the modules imported; on exit, the dict yielded holds what they depend on: ``files`` (local
    Python files outside the interpreter's prefixes, with their sha256) and ``dists`` (installed distributions, with
    their versions). Modules already imported from ``model``'s folder count too (a second analysis in one process
    imports them no more)."""
    before = set(sys.modules)
    found: dict[str, Any] = {}
    opened: set[str] = set()
    _OPENED.append(opened)
    try:
        yield found
    finally:
        _OPENED.remove(opened)
        names = set(sys.modules) - before
        folder = os.path.realpath(model.parent) + os.sep if model is not None and model.is_file() else None
        if folder is not None:
            names |= {n for n in before if os.path.realpath(getattr(sys.modules.get(n), "__file__", None) or "/").startswith(folder)}
        found.update(_dependencies(names, opened))


def _dependencies(names: set[str], opened: Iterable[str] = ()) -> dict[str, Any]:
    prefixes = _system_prefixes()
    files: dict[str, str] = {}
    skipped = prefixes + _VOLATILE
    for path in sorted(opened):  # data files the model's code read (a config beside the model file)
        real = os.path.realpath(path)
        if not real.startswith(skipped) and os.path.isfile(real):
            digest = _sha256_file(Path(real))
            if digest is not None:
                files[real] = digest
    tops: set[str] = set()
    for name in sorted(names):
        module = sys.modules.get(name)
        origin = getattr(module, "__file__", None)
        if not origin:
            continue
        real = os.path.realpath(origin)
        if real.startswith(prefixes):
            tops.add(name.partition(".")[0])
            continue
        digest = _sha256_file(Path(real))
        if digest is not None:
            files[real] = digest
    owners = importlib.metadata.packages_distributions()
    dists = {d: _version(d) for top in sorted(tops) for d in owners.get(top, ())}
    return {"files": files, "dists": dists}


def _still_holds(deps: dict[str, Any]) -> bool:
    files, dists = deps.get("files") or {}, deps.get("dists") or {}
    return all(_sha256_file(Path(p)) == h for p, h in files.items()) and all(_version(d) == v for d, v in dists.items())


def load(key: str) -> ModelSummary | None:
    """The summary cached under ``key`` whose dependencies still hold; None otherwise (a miss)."""
    path = cache_dir() / f"{key}.json"
    try:
        text = path.read_text(encoding="utf-8") if path.is_file() and path.stat().st_size <= MAX_INPUT_BYTES else None
    except OSError:
        return None
    if text is None:
        return None
    try:
        doc = loads_json_bounded(text, str(path))
        if not isinstance(doc, dict) or doc.get("format") != ENTRY_FORMAT or not _still_holds(doc.get("deps") or {}):
            return None
        return ModelSummary.from_dict(doc["summary"])
    except Exception:  # noqa: BLE001 - a damaged entry is a miss, never an error
        return None


def store(key: str, summary: ModelSummary, deps: dict[str, Any]) -> None:
    """Write the entry atomically; a cache folder that cannot be written is left alone."""
    folder = cache_dir()
    doc = {"format": ENTRY_FORMAT, "summary": summary.to_dict(), "deps": deps}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".entry-", suffix=".tmp", dir=folder)
    except OSError:
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, sort_keys=True)
        os.replace(tmp, folder / f"{key}.json")
        _prune(folder)
    except (OSError, TypeError, ValueError):
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _prune(folder: Path) -> None:
    entries = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime)
    for old in entries[:-MAX_ENTRIES]:
        try:
            old.unlink()
        except OSError:
            pass
