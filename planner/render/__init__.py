"""Write a plan directory: plan.json, the engine's configs and launch scripts, the report, a README.

The planner owns only the files it wrote: the manifest ``.planner`` (JSON) lists them. Re-planning
replaces those and deletes the ones the new plan no longer renders; every other file (checkpoints,
notes, smoke.json, the model file) stays. A file the planner did not write is never overwritten
without ``--force``, and the model file never. The update is a journaled sequence of renames under
a lock (planner.fileio.update_dir): an interrupted one is finished or rolled back on the next run,
and a concurrent writer fails at once.

Files carry the planner version and the canonical planning command in their header (model path
relative to the plan directory, never ``--out``, ``--force`` or the working directory) and nothing
time- or host-dependent: the same inputs give byte-identical files from any directory or checkout.
"""

from __future__ import annotations

import ast
import json
import os
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from planner import __version__
from planner.engines import get_spec
from planner.errors import UsageError
from planner.fileio import FileSpec, dir_lock, dumps_json, recover_dir, update_dir
from planner.model_ref import relative_ref
from planner.report import report_files
from planner.safe_dir import Outside, SafeDir, check_rel, sha256_bytes
from planner.solve.plan import Plan
from planner.solve.settings import SECTIONS
from planner.templating import one_line, render_template, shell_quote

__all__ = [
    "MARKER",
    "canonical_command",
    "canonical_plan",
    "check_output_dir",
    "one_line",
    "render_files",
    "render_template",
    "shell_quote",
    "write_plan_dir",
]

#: the manifest: JSON {"planner": version, "files": [relative paths the planner wrote]}
MARKER = ".planner"
#: the largest manifest read (bytes)
MAX_MANIFEST_BYTES = 4 * 2**20
#: prefix of the staging folders of an update inside the plan directory (.planner.tmp.ID, .planner.old.ID)
STAGING = ".planner"

EXECUTABLE_SUFFIXES = (".sh",)


def manifest_hashes(path: Path) -> dict[str, str | None] | None:
    """{relative path: sha256 the planner recorded (None: a manifest of an older planner, which recorded none)} of
    the manifest in ``path``; None when there is no manifest, it is the old bare marker or it is not the planner's.
    Names that leave the directory are dropped: the manifest is untrusted input."""
    try:
        with SafeDir(path) as sd:
            doc = json.loads(sd.read_bytes(MARKER, MAX_MANIFEST_BYTES).decode("utf-8"))
    except (OSError, ValueError, Outside):
        return None
    files = doc.get("files") if isinstance(doc, dict) else None
    hashes = doc.get("sha256", {}) if isinstance(doc, dict) else {}
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files) or not isinstance(hashes, dict):
        return None
    return {f: (h if isinstance(h, str) else None) for f in files if _safe_rel(f) for h in [hashes.get(f)]}


def owned_files(path: Path) -> tuple[set[str], list[str]]:
    """(the files in ``path`` the planner wrote and nobody changed since, why each other listed file is not one).

    A listed file is the planner's only when it is a regular file reached without a symlink and its bytes hash to
    what the manifest recorded; a symlink, a directory, a name outside, an edited file or one an older planner listed
    without a hash is not, and is left as it is."""
    listed = manifest_hashes(path)
    owned: set[str] = {MARKER}
    foreign: list[str] = []
    if not listed:
        return owned, foreign
    with SafeDir(path) as sd:
        for rel, want in sorted(listed.items()):
            kind = sd.kind(rel)
            if kind == "none":
                continue
            if kind != "file":
                foreign.append(f"{rel} (a {'path through a symlink' if kind == 'outside' else kind}, not the file the planner wrote)")
            elif want is None:
                foreign.append(f"{rel} (listed by an older planner that recorded no hash)")
            elif sd.file_hash(rel) != want:
                foreign.append(f"{rel} (changed since the planner wrote it)")
            else:
                owned.add(rel)
    return owned, foreign


def _safe_rel(rel: str) -> bool:
    """A relative path inside the directory (a manifest never makes us touch a file outside it)."""
    try:
        check_rel(rel)
    except Outside:
        return False
    return rel != MARKER


def check_output_dir(path: str | Path, force: bool = False) -> None:
    """Refuse an ``--out`` the planner cannot write: a file, under a file, or not writable (exit 2).

    Which existing files would be shadowed is only known once the plan is rendered (see write_plan_dir).
    """
    del force  # shadowing is judged per file in write_plan_dir
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {str(path)!r} is a file, not a directory.", "Choose a directory path for --out.")
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise UsageError(f"--out {str(path)!r} is inside {str(probe)!r}, which is a file.", "Choose a directory path for --out.")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"--out {str(path)!r}: {str(probe)!r} is not writable.", "Choose a directory you can write to.")


def canonical_plan(plan: Plan, out_dir: Path) -> Plan:
    """``plan`` with the files it names (model file, hardware profiles, measured profile) recorded relative to
    ``out_dir``, so the bytes do not depend on where we ran and the recorded command works in the plan directory."""
    model, cluster = plan.settings.model, plan.settings.cluster
    paths: dict[str, Any] = {}
    if model.model_file:
        paths["model_file"] = relative_ref(str(model.model_file), out_dir)
    if cluster.hardware_profiles:
        paths["hardware_profiles"] = tuple(relative_ref(str(p), out_dir) for p in cluster.hardware_profiles)
    if cluster.profile:
        paths["profile"] = relative_ref(str(cluster.profile), out_dir)
    return replace(plan, settings=plan.settings.but(**paths))


def _arg_text(value: Any) -> str:
    """A --model-arg value as the CLI parses it back (planner.model.args.parse_model_args)."""
    if isinstance(value, str):
        try:
            ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            if value.lower() not in ("true", "false", "none"):
                return value
        return repr(value)
    return repr(value)


#: settings written first and by hand in the canonical command: the argument, the cluster, the engine, repeated options
_FIRST = ("model_file", "gpus", "engine", "model_args", "leaf", "hardware_profiles")


def _setting_words(name: str, flag: str, kind: str, value: Any, default: Any) -> list[str]:
    """The words of one setting in a `planner plan` command (none where it has its default)."""
    if value is None or value == default or (kind.startswith("tuple") and not value):
        return []
    if kind == "bool | None":
        return [flag] if value else [f"--no-{flag[2:]}"]
    if kind == "bool":
        return [flag] if value else [f"--no-{flag[2:]}"]
    if kind.startswith("tuple"):
        return [flag, ",".join(str(v) for v in value)]
    return [flag, f"{value:g}" if isinstance(value, float) else str(value)]


def canonical_command(plan: Plan) -> str:
    """The `planner plan` command that re-makes ``plan`` when run in the plan directory (shell-quoted).

    Built from plan.json's inputs (model path as recorded, i.e. relative to the plan directory), never from
    the command as typed: ``--force``, the working directory and the spelling of ``--out`` leave no trace.
    """
    inp = plan.settings.flat()
    words = ["planner", "plan", str(inp["model_file"] or "MODEL.py"), "--gpus", str(inp["gpus"] or ""), "--engine", plan.layout.engine]
    for k, v in sorted((inp["model_args"] or {}).items()):
        words += ["--model-arg", f"{k}={_arg_text(v)}"]
    for leaf in inp["leaf"] or ():
        words += ["--leaf", str(leaf)]
    for p in inp["hardware_profiles"] or ():
        words += ["--hardware-profile", str(p)]
    for f in (f for cls in SECTIONS.values() for f in fields(cls) if f.metadata["cli"] and not f.metadata["knob"] and f.name not in _FIRST):
        flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        words += _setting_words(f.name, flag, str(f.type), inp[f.name], f.default)
    words += ["--out", "."]
    return " ".join(shell_quote(w) if i > 1 else w for i, w in enumerate(words))


def render_files(plan: Plan, command: str | None = None, out_dir: Path | None = None) -> dict[str, str]:
    """Every file of the plan directory as {relative path: text} (deterministic), the manifest included.

    ``out_dir`` is where the files will live: the model path is recorded relative to it. ``command`` is the
    header's command; None gives :func:`canonical_command`.
    """
    if out_dir is not None:
        plan = canonical_plan(plan, out_dir)
    if command is None:
        command = canonical_command(plan)
    renderer = get_spec(plan.layout.engine).part("render")
    files: dict[str, str] = {"plan.json": dumps_json(plan.to_dict())}
    files.update(renderer.render(plan, command, None))
    files.update(report_files(plan, command))
    hashes = {rel: sha256_bytes(text.encode("utf-8")) for rel, text in files.items()}
    files[MARKER] = dumps_json({"planner": __version__, "files": sorted(files), "sha256": hashes})
    return files


def _mode(rel: str) -> int:
    return 0o755 if rel.endswith(EXECUTABLE_SUFFIXES) or rel == "hostfile.sh" else 0o644


def _legacy_leftovers(path: Path) -> list[str]:
    """Leftovers of the whole-directory swap of planner <= 0.x beside ``path`` (``.NAME.old.*``, ``.NAME.tmp.*``),
    named and never touched: they are outside the plan directory, so whether they are the planner's is not known."""
    parent = path.parent
    if not parent.is_dir():
        return []
    return [
        f"left {p} as it is: it looks like a copy of {path.name} left by planner <= 0.x, but it is outside the plan directory; check it and delete it by hand"
        for p in sorted([*parent.glob(f".{path.name}.old.*"), *parent.glob(f".{path.name}.tmp.*")])
    ]


def write_plan_dir(path: str | Path, plan: Plan, command: str | None = None, force: bool = False) -> list[str]:
    """Write the plan's files into ``path``, replacing only the planner's own files; returns notes to print.

    Exit-2 errors: ``path`` unusable, another writer holds the directory, a file the planner did not write (or
    wrote and someone changed since: its hash differs from the manifest's) would be overwritten (allowed with
    ``force``), a directory stands where a rendered file goes (never replaced, ``force`` or not), or a rendered file
    would overwrite the model file (never).
    """
    path = Path(path)
    check_output_dir(path, force)
    notes = _legacy_leftovers(path.absolute())
    path.mkdir(parents=True, exist_ok=True)
    with dir_lock(path):
        notes += recover_dir(path, STAGING)
        files = render_files(plan, command, path)
        owned, foreign = owned_files(path)
        model = path / files_model(files)
        for rel in files:
            target = path / rel
            if model.is_file() and target.exists() and os.path.samefile(target, model):
                raise UsageError(
                    f"the plan would overwrite the model file {str(model)!r} with its {rel}.",
                    "Move the model file or rename it; the planner never replaces it.",
                )
        with SafeDir(path) as sd:
            kinds = {rel: sd.kind(rel) for rel in files}
        blocked = sorted(rel for rel, k in kinds.items() if k in ("dir", "other", "outside"))
        if blocked:
            raise UsageError(
                f"--out {str(path)!r} holds {', '.join(blocked)} where the plan writes a file, and it is not a file (a directory, "
                "a device, or a path through a symlink); the planner never deletes a directory's contents, --force or not.",
                "Move it out of the plan directory, or choose another --out.",
            )
        shadowed = sorted(rel for rel, k in kinds.items() if rel not in owned and k != "none")
        if shadowed and not force:
            raise UsageError(
                f"--out {str(path)!r} holds files the planner did not write, or changed since it wrote them, that this plan would replace: {', '.join(shadowed)}.",
                "Move them, choose another --out, or pass --force to replace them (other files are always kept).",
            )
        notes += [f"left {f} untouched" for f in foreign if f.split(" (")[0] not in files]
        remove = sorted(rel for rel in owned - set(files) if not (model.is_file() and os.path.samefile(path / rel, model)))
        order = [r for r in sorted(files) if r != MARKER] + [MARKER]  # the manifest last: it marks the update done
        update_dir(path, {r: FileSpec(files[r], _mode(r)) for r in order}, remove, STAGING)
    return notes


def files_model(files: dict[str, str]) -> str:
    """The model file's path (relative to the plan directory) as recorded in the rendered plan.json."""
    return str(json.loads(files["plan.json"]).get("inputs", {}).get("model_file") or "")
