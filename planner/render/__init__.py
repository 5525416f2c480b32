"""Write a plan directory: plan.json, the engine's configs and launch scripts, the report, a README.

Everything is rendered into a temporary directory beside the target and
moved into place in one rename, so a failed render leaves nothing
half-written; an existing directory that is not a planner output is never
replaced without ``--force``. Files carry the planner version and the command
in their header and nothing time- or host-dependent: the same inputs give
byte-identical files.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Callable

from planner import __version__
from planner.errors import UsageError
from planner.fileio import dumps_json, replace_dir_atomic, write_text_atomic
from planner.render.deepspeed import render_deepspeed
from planner.render.megatron import render_megatron
from planner.render.torchpp import render_torch
from planner.report import report_files
from planner.solve.plan import Plan
from planner.templating import one_line, render_template, shell_quote

__all__ = ["MARKER", "RENDERERS", "check_output_dir", "one_line", "render_files", "render_template", "shell_quote", "write_plan_dir"]

MARKER = ".planner"

#: engine name -> its renderer: (plan, command, out_dir) -> {relative path: text}
RENDERERS: dict[str, Callable[[Plan, str, "Path | None"], dict[str, str]]] = {
    "deepspeed": render_deepspeed,
    "megatron": render_megatron,
    "torch": render_torch,
}


def is_planner_dir(path: Path) -> bool:
    return (path / MARKER).is_file()


def check_output_dir(path: str | Path, force: bool) -> None:
    """Refuse to replace a non-empty directory that the planner did not write, unless ``force``."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {str(path)!r} is a file, not a directory.", "Choose a directory path for --out.")
    if path.is_dir() and any(path.iterdir()) and not is_planner_dir(path) and not force:
        raise UsageError(
            f"--out {str(path)!r} already exists and was not written by planner; it would be replaced.",
            "Choose another directory, or pass --force to replace it.",
        )


def render_files(plan: Plan, command: str, out_dir: Path | None = None) -> dict[str, str]:
    """Every file of the plan directory as {relative path: text} (deterministic).

    ``out_dir`` is where the files will live (for paths the scripts need); it defaults to the working directory.
    """
    files: dict[str, str] = {"plan.json": dumps_json(plan.to_dict()), MARKER: f"planner {__version__}\n"}
    renderer = RENDERERS.get(plan.layout.engine)
    if renderer is None:
        raise UsageError(f"no renderer for engine {plan.layout.engine!r}", f"Plan with one of: {', '.join(RENDERERS)}.")
    files.update(renderer(plan, command, out_dir))
    files.update(report_files(plan, command))
    return files


EXECUTABLE_SUFFIXES = (".sh",)


def write_plan_dir(path: str | Path, plan: Plan, command: str) -> None:
    """Render the plan directory and move it into place atomically."""
    path = Path(path)
    files = render_files(plan, command, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp.", dir=path.parent))
    try:
        for rel, text in sorted(files.items()):
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            mode = 0o755 if rel.endswith(EXECUTABLE_SUFFIXES) or rel == "hostfile.sh" else 0o644
            write_text_atomic(target, text, mode=mode)
        replace_dir_atomic(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
