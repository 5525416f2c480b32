"""Atomic, deterministic writes: a reader never sees a half-written file or directory."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


def dumps_json(data: Any) -> str:
    """Canonical JSON text: sorted keys, two-space indent, trailing newline."""
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_text_atomic(path: str | os.PathLike, text: str, mode: int | None = None) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        if mode is not None:
            os.chmod(tmp, mode)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def replace_dir_atomic(staging: Path, target: Path) -> None:
    """Move a fully written ``staging`` directory to ``target``, replacing it.

    The old directory is renamed aside first and removed only after the new one
    is in place, so ``target`` is never left half-written.
    """
    target = Path(target)
    if target.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        os.rmdir(aside)
        os.replace(target, aside)
        try:
            os.replace(staging, target)
        except BaseException:
            os.replace(aside, target)
            raise
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(staging, target)
