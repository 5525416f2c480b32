"""Atomic, deterministic writes: a reader never sees a half-written file, and no file we did not write is lost.

Units: sizes in bytes, depths in levels of nesting.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import UsageError
from planner.safe_dir import Outside, SafeDir, check_rel, sha256_bytes

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


#: the longest integer a JSON input may hold (digits): no count, size or time the planner reads is longer, and Python
#: refuses to convert integers of over 4,300 digits
MAX_INT_DIGITS = 30


def oversized_int(text: str) -> str | None:
    """Why the JSON integer literal ``text`` is refused (over :data:`MAX_INT_DIGITS` digits), else None."""
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        return f"an integer of {digits:,} digits ({text[:12]}...), longer than any the planner reads ({MAX_INT_DIGITS} digits)"
    return None


def not_finite(name: str) -> str:
    """Why the constant ``name`` (NaN, Infinity, -Infinity) that Python's json reads is refused."""
    return f"{name}, which is not JSON (a JSON number is finite)"


def _bounded_int(text: str) -> int:
    why = oversized_int(text)
    if why:
        raise ValueError(why)
    return int(text)


def _not_json(name: str) -> Any:
    raise ValueError(not_finite(name))


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key[:60]!r} is written twice in one object")
        out[key] = value
    return out


def strict_json(text: str) -> Any:
    """``json.loads`` as strict as the files the planner writes: integers of at most :data:`MAX_INT_DIGITS` digits, no
    NaN or Infinity, no key written twice in an object. Raises ValueError (RecursionError for absurd nesting)."""
    return json.loads(text, parse_int=_bounded_int, parse_constant=_not_json, object_pairs_hook=_unique_keys)


def loads_json_bounded(text: str, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """:func:`strict_json` with the nesting bounded: deeper or malformed input is a UsageError, never a RecursionError."""
    if json_depth(text) > max_depth:
        raise UsageError(f"{what} nests deeper than {max_depth} levels.", "It is not a file the planner wrote; check it.")
    try:
        return strict_json(text)
    except ValueError as e:
        raise UsageError(f"{what} is not valid JSON: {e}.") from None


def read_text_bounded(path: str | os.PathLike[str], what: str, max_bytes: int = MAX_INPUT_BYTES, errors: str = "strict") -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes`` (FIFOs and devices are refused by type, never opened);
    ``errors="replace"`` reads damaged bytes as U+FFFD instead of refusing the file."""
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
        return path.read_bytes().decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise UsageError(f"{what} {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start}).") from None
    except OSError as e:
        raise UsageError(f"cannot read {what} {str(path)!r}: {e.strerror or e}.") from None


def write_text_atomic(path: str | os.PathLike[str], text: str, mode: int | None = None) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same directory and a rename."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        raise UsageError(
            f"{str(path)!r} exists and is not a regular file (a directory, device or FIFO); the planner replaces only files.", "Write to a file path."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644 if mode is None else mode)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise UsageError(f"cannot write {str(path)!r}: {e.strerror}.", "Free space on that device or write elsewhere; nothing was replaced.") from None
        raise
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


def _read_journal(sd: SafeDir, rel: str) -> dict[str, Any] | None:
    """An update's journal, strictly typed: {"names": [rel], "existed": [rel], "new": {rel: sha256}}; None when it
    is not one the planner wrote (malformed, a symlink, too big, a name outside the directory)."""
    try:
        doc = loads_json_bounded(sd.read_bytes(rel, MAX_INPUT_BYTES).decode("utf-8"), rel, 4)
    except (Outside, OSError, UsageError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict):
        return None
    names, existed, new = doc.get("names"), doc.get("existed"), doc.get("new", {})
    if not (isinstance(names, list) and isinstance(existed, list) and isinstance(new, dict)):
        return None
    try:
        for rel_name in [*names, *existed, *new]:
            check_rel(rel_name)
    except Outside:
        return None
    if not set(existed) <= set(names) or not all(isinstance(h, str) for h in new.values()):
        return None
    return {"names": names, "existed": existed, "new": new}


def _staging(sd: SafeDir, prefix: str, kind: str) -> list[str]:
    return [n for n in sd.listdir() if n.startswith(f"{prefix}.{kind}.")]


def recover_dir(target: Path, prefix: str) -> list[str]:
    """Finish or undo an interrupted :func:`update_dir` in ``target``; returns one message per leftover handled.

    ``<prefix>.tmp.ID`` holds the new files not yet moved in; ``<prefix>.old.ID`` the previous files moved
    aside and ``journal.json`` (which names existed before, and the hash of each new file). A swap whose new files
    are all in place is finished (the old copies removed); any other is rolled back, so the directory is exactly
    as before. The leftovers are untrusted (a plan directory comes from a repository): every name is walked from
    ``target`` without following a symlink (planner.safe_dir), a staging folder that is a symlink or a journal
    that is not the planner's is left untouched and named, and a file placed by the update is deleted only when
    its bytes hash to what the journal says was written.
    """
    notes: list[str] = []
    with SafeDir(target) as sd:
        for old in _staging(sd, prefix, "old"):
            ident = old[len(prefix) + len(".old.") :]
            tmp = f"{prefix}.tmp.{ident}"
            if sd.kind(old) != "dir":
                notes.append(f"left {old} untouched: a staging name that is not a directory the planner made (a symlink or a file); remove it once checked")
                continue
            journal_kind = sd.kind(f"{old}/{JOURNAL}")
            if journal_kind == "none":  # crashed before the journal was complete: nothing was moved yet
                sd.remove_tree(old)
                notes.append(f"removed {old} left by an interrupted write (nothing had been replaced)")
                continue
            plan = _read_journal(sd, f"{old}/{JOURNAL}")
            if plan is None:
                notes.append(f"left {old} untouched: its journal is not one the planner wrote; check it and remove it by hand")
                continue
            pending = sd.walk_files(tmp) if sd.kind(tmp) == "dir" else []
            if not pending:
                sd.remove_tree(old)
                if sd.kind(tmp) == "dir":
                    sd.remove_tree(tmp)
                notes.append(f"finished an interrupted write: removed the previous files kept in {old}")
                continue
            kept_back: list[str] = []
            for rel in plan["names"]:
                kept = f"{old}/files/{rel}"
                try:
                    if sd.kind(kept) in ("file", "symlink"):
                        if sd.kind(rel) == "dir":
                            kept_back.append(rel)
                            continue
                        sd.rename(kept, rel)
                    elif rel not in plan["existed"] and sd.kind(rel) == "file":
                        if plan["new"].get(rel) is not None and sd.file_hash(rel) == plan["new"][rel]:
                            sd.unlink(rel)
                        else:
                            kept_back.append(rel)
                except Outside:
                    kept_back.append(rel)
            if sd.kind(tmp) == "dir":
                sd.remove_tree(tmp)
            if kept_back:
                notes.append(
                    f"rolled back an interrupted write ({old}) but left {', '.join(kept_back[:5])} as they are (not what the "
                    f"journal says the planner wrote); the previous copies stay in {old}/files"
                )
                continue
            sd.remove_tree(old)
            notes.append(f"rolled back an interrupted write ({old}): the previous files are restored")
        for tmp in _staging(sd, prefix, "tmp"):
            if sd.kind(tmp) != "dir":
                notes.append(f"left {tmp} untouched: a staging name that is not a directory the planner made; remove it once checked")
                continue
            sd.remove_tree(tmp)
            notes.append(f"removed {tmp} left by an interrupted write (it held unfinished new files)")
    return notes


def update_dir(target: Path, files: Mapping[str, FileSpec], remove: list[str], prefix: str) -> None:
    """Replace ``files`` (relative paths) in ``target`` and delete ``remove``, leaving every other file.

    Steps (each a rename, so an interruption is undone or finished by :func:`recover_dir`): write every new
    file into ``<prefix>.tmp.ID``; write the journal into ``<prefix>.old.ID``; move each file being
    replaced or removed into ``<prefix>.old.ID/files``; move each new file in, the one named last in
    ``files`` last (the manifest); delete the two folders. Every path is walked from ``target`` without following a
    symlink (planner.safe_dir); what is at a name to replace or remove must be a file or a symlink (moved as a
    link), never a directory. Call under :func:`dir_lock`.
    """
    ident = secrets.token_hex(4)
    tmp, old = f"{prefix}.tmp.{ident}", f"{prefix}.old.{ident}"
    with SafeDir(target) as sd:
        names = sorted(set(files) | set(remove))
        kinds = {n: sd.kind(n) for n in names}
        wrong = [n for n, k in kinds.items() if k not in ("none", "file", "symlink")]
        if wrong:
            raise UsageError(f"{', '.join(wrong)} in {str(target)!r} cannot be replaced: not a regular file (a directory or a path through a symlink).")
        sd.mkdir(tmp)
        encoded = {rel: spec.text.encode("utf-8") for rel, spec in files.items()}
        try:
            for rel, spec in files.items():
                _write_or_full(sd, f"{tmp}/{rel}", encoded[rel], spec.mode, target)
                _step("staged " + rel)
        except UsageError:
            sd.remove_tree(tmp)  # nothing was replaced yet
            raise
        existed = [n for n in names if kinds[n] != "none"]
        sd.mkdir(old)
        sd.mkdir(f"{old}/files")
        journal = dumps_json({"names": names, "existed": existed, "new": {rel: sha256_bytes(b) for rel, b in encoded.items()}}).encode()
        _write_or_full(sd, f"{old}/{JOURNAL}.part", journal, 0o644, target)
        sd.rename(f"{old}/{JOURNAL}.part", f"{old}/{JOURNAL}")
        _step("journal")
        for rel in existed:
            sd.rename(rel, f"{old}/files/{rel}")
            _step("aside " + rel)
        for rel in files:
            sd.rename(f"{tmp}/{rel}", rel)
            _step("placed " + rel)
        sd.remove_tree(tmp)
        _step("removed tmp")
        sd.remove_tree(old)


def _write_or_full(sd: SafeDir, rel: str, data: bytes, mode: int, target: Path) -> None:
    """Write through ``sd``; a full device or quota is a UsageError (exit 2), never a half-written success."""
    try:
        sd.write(rel, data, mode)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES):
            raise UsageError(f"cannot write into {str(target)!r}: {e.strerror}.", "Free space or choose another --out; nothing was replaced.") from None
        raise
