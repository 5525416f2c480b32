"""Atomic, deterministic writes: a reader never sees a half-written file, and no file we did not write is lost.

Units: sizes in bytes, depths in levels of nesting.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import UsageError

#: largest JSON or YAML input the planner reads (bytes)
MAX_INPUT_BYTES = 64 * 2**20
#: deepest nesting of brackets accepted in a JSON input
MAX_JSON_DEPTH = 200

#: test hook: called with the name of each step of a directory update (tests raise in it to simulate a crash)
STEP_HOOK: Callable[[str], None] | None = None


def dumps_json(data: Any) -> str:
    """Canonical JSON text: sorted keys, two-space indent, trailing newline."""
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def json_depth(text: str) -> int:
    """Deepest bracket nesting of JSON ``text`` (brackets inside strings are not counted)."""
    depth = deepest = 0
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def loads_json_bounded(text: str, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` with the nesting bounded: deeper input is a UsageError, never a RecursionError."""
    if json_depth(text) > max_depth:
        raise UsageError(f"{what} nests deeper than {max_depth} levels.", "It is not a file the planner wrote; check it.")
    try:
        return json.loads(text)
    except ValueError as e:
        raise UsageError(f"{what} is not valid JSON: {e}.") from None


def read_text_bounded(path: str | os.PathLike[str], what: str, max_bytes: int = MAX_INPUT_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes`` (FIFOs and devices are refused, never read)."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as e:
        raise UsageError(f"cannot read {what} {str(path)!r}: {e.strerror or e}.") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{what} {str(path)!r} is not a regular file.")
    if st.st_size > max_bytes:
        raise UsageError(f"{what} {str(path)!r} is {st.st_size:,} bytes; the limit is {max_bytes:,}.")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{what} {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start}).") from None
    except OSError as e:
        raise UsageError(f"cannot read {what} {str(path)!r}: {e.strerror or e}.") from None


def write_text_atomic(path: str | os.PathLike[str], text: str, mode: int | None = None) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.chmod(tmp, 0o644 if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# ------------------------------------------------------------------ directory updates

JOURNAL = "journal.json"


@dataclass(frozen=True)
class FileSpec:
    """One file to write: its text and permission bits."""

    text: str
    mode: int = 0o644


def _step(name: str) -> None:
    if STEP_HOOK is not None:
        STEP_HOOK(name)


@contextmanager
def dir_lock(directory: Path) -> Iterator[None]:
    """An exclusive flock on ``directory`` itself; a second writer fails at once with a UsageError (exit 2)."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UsageError(
                    f"{str(directory)!r} is being written by another planner process.", "Wait for it to finish, or write to another directory."
                ) from None
            raise
        yield
    finally:
        os.close(fd)  # releases the lock


def recover_dir(target: Path, prefix: str) -> list[str]:
    """Finish or undo an interrupted :func:`update_dir` in ``target``; returns one message per leftover handled.

    ``<prefix>.tmp.ID`` holds the new files not yet moved in; ``<prefix>.old.ID`` the previous files moved
    aside and ``journal.json`` (which names existed before). A swap whose new files are all in place is
    finished (the old copies removed); any other is rolled back, so the directory is exactly as before.
    """
    notes: list[str] = []
    for old in sorted(target.glob(f"{prefix}.old.*")):
        ident = old.name[len(prefix) + len(".old.") :]
        tmp = target / f"{prefix}.tmp.{ident}"
        journal = old / JOURNAL
        if not journal.is_file():  # crashed before the journal was complete: nothing was moved yet
            shutil.rmtree(old, ignore_errors=True)
            notes.append(f"removed {old.name} left by an interrupted write (nothing had been replaced)")
            continue
        plan = json.loads(journal.read_text(encoding="utf-8"))
        pending = [p for p in tmp.rglob("*") if p.is_file()] if tmp.is_dir() else []
        if not pending:
            shutil.rmtree(old)
            shutil.rmtree(tmp, ignore_errors=True)
            notes.append(f"finished an interrupted write: removed the previous files kept in {old.name}")
            continue
        for rel in plan["names"]:
            here, kept = target / rel, old / "files" / rel
            if kept.exists() or kept.is_symlink():
                here.parent.mkdir(parents=True, exist_ok=True)
                os.replace(kept, here)
            elif rel not in plan["existed"] and (here.exists() or here.is_symlink()):
                here.unlink()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old)
        notes.append(f"rolled back an interrupted write ({old.name}): the previous files are restored")
    for tmp in sorted(target.glob(f"{prefix}.tmp.*")):
        shutil.rmtree(tmp, ignore_errors=True)
        notes.append(f"removed {tmp.name} left by an interrupted write (it held unfinished new files)")
    return notes


def update_dir(target: Path, files: Mapping[str, FileSpec], remove: list[str], prefix: str) -> None:
    """Replace ``files`` (relative paths) in ``target`` and delete ``remove``, leaving every other file.

    Steps (each a rename, so an interruption is undone or finished by :func:`recover_dir`): write every new
    file into ``<prefix>.tmp.ID``; write the journal into ``<prefix>.old.ID``; move each file being
    replaced or removed into ``<prefix>.old.ID/files``; move each new file in, the one named last in
    ``files`` last (the manifest); delete the two folders. Call under :func:`dir_lock`.
    """
    ident = secrets.token_hex(4)
    tmp, old = target / f"{prefix}.tmp.{ident}", target / f"{prefix}.old.{ident}"
    tmp.mkdir()
    for rel, spec in files.items():
        write_text_atomic(tmp / rel, spec.text, mode=spec.mode)
        _step("staged " + rel)
    names = sorted(set(files) | set(remove))
    existed = [n for n in names if (target / n).exists() or (target / n).is_symlink()]
    (old / "files").mkdir(parents=True)
    write_text_atomic(old / JOURNAL, dumps_json({"names": names, "existed": existed}))
    _step("journal")
    for rel in existed:
        aside = old / "files" / rel
        aside.parent.mkdir(parents=True, exist_ok=True)
        os.replace(target / rel, aside)
        _step("aside " + rel)
    for rel in files:
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp / rel, target / rel)
        _step("placed " + rel)
    shutil.rmtree(tmp)
    _step("removed tmp")
    shutil.rmtree(old)
