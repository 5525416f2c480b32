"""Paths inside one directory, never outside it: every operation walks from the directory's own descriptor, one
component at a time, and refuses a symbolic link on the way (``O_NOFOLLOW``, ``*at`` calls through ``dir_fd``).

A plan directory comes from a repository, so the names its bookkeeping lists (the manifest, an update's journal, its
staging folders) are untrusted input: ``linkdir/x`` where ``linkdir`` is a symlink to another directory, ``../x``,
or an absolute path. :class:`SafeDir` answers what is at a relative path without following links, and moves,
writes and deletes only there. A name it refuses raises :class:`Outside`, which the callers turn into a message and
leave the thing untouched.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import PurePosixPath

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class Outside(ValueError):
    """A name that is not a plain relative path inside the directory, or whose way passes a symlink or a non-directory."""


def check_rel(rel: str) -> PurePosixPath:
    """``rel`` as a relative path of plain components (no ``..``, ``.``, empty or absolute parts, no NUL)."""
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel:
        raise Outside(f"{rel!r} is not a relative path")
    p = PurePosixPath(rel)
    if p.is_absolute() or any(part in ("", ".", "..") for part in rel.split("/")):
        raise Outside(f"{rel!r} leaves the directory or is not a plain relative path")
    return p


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class SafeDir:
    """One directory, opened once (its descriptor held until :meth:`close`); every path is relative to it."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> SafeDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _parent(self, rel: str, create: bool = False) -> Iterator[tuple[int, str]]:
        """(descriptor of ``rel``'s parent directory, ``rel``'s last name); each component a real directory, never a
        symlink (created when ``create``)."""
        parts = check_rel(rel).parts
        fd = os.dup(self.fd)
        try:
            for part in parts[:-1]:
                try:
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(part, 0o755, dir_fd=fd)
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise Outside(f"{rel!r} passes through {part!r}, which is a symlink or not a directory") from None
                    raise
                os.close(fd)
                fd = nxt
            yield fd, parts[-1]
        finally:
            os.close(fd)

    def lstat(self, rel: str) -> os.stat_result | None:
        """What is at ``rel`` itself (a symlink is not followed); None when nothing is."""
        try:
            with self._parent(rel) as (fd, name):
                return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def kind(self, rel: str) -> str:
        """'file', 'dir', 'symlink', 'other' or 'none' for what is at ``rel``; 'outside' when its way is refused."""
        try:
            st = self.lstat(rel)
        except Outside:
            return "outside"
        except NotADirectoryError:
            return "outside"
        if st is None:
            return "none"
        if stat.S_ISLNK(st.st_mode):
            return "symlink"
        if stat.S_ISREG(st.st_mode):
            return "file"
        return "dir" if stat.S_ISDIR(st.st_mode) else "other"

    def read_bytes(self, rel: str, limit: int) -> bytes:
        """The bytes of the regular file at ``rel`` (at most ``limit``); a symlink, FIFO or device raises Outside."""
        with self._parent(rel) as (dfd, name):
            try:
                fd = os.open(name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0), dir_fd=dfd)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise Outside(f"{rel!r} is a symlink") from None
                raise
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise Outside(f"{rel!r} is not a regular file")
                if st.st_size > limit:
                    raise Outside(f"{rel!r} is {st.st_size:,} bytes, over {limit:,}")
                chunks, total = [], 0
                while total <= limit:
                    chunk = os.read(fd, 1 << 20)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    total += len(chunk)
                return b"".join(chunks)[: limit + 1]
            finally:
                os.close(fd)

    def file_hash(self, rel: str, limit: int = 256 * 2**20) -> str | None:
        """sha256 of the regular file at ``rel``; None for anything else (absent, symlink, directory, refused way)."""
        try:
            return sha256_bytes(self.read_bytes(rel, limit))
        except (Outside, OSError):
            return None

    def write(self, rel: str, data: bytes, mode: int = 0o644) -> None:
        """Create the file ``rel`` (parents made as real directories); it must not exist."""
        with self._parent(rel, create=True) as (dfd, name):
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), mode, dir_fd=dfd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
                os.fchmod(fd, mode)
            finally:
                os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst`` (both inside; ``dst``'s parents made); the entry itself moves, a symlink as a link."""
        with self._parent(src) as (sfd, sname), self._parent(dst, create=True) as (dfd, dname):
            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)

    def unlink(self, rel: str) -> None:
        """Delete the file or symlink ``rel`` (never a directory)."""
        with self._parent(rel) as (fd, name):
            os.unlink(name, dir_fd=fd)

    def mkdir(self, rel: str) -> None:
        with self._parent(rel, create=True) as (fd, name):
            os.mkdir(name, 0o755, dir_fd=fd)

    def listdir(self, rel: str = "") -> list[str]:
        """The names in directory ``rel`` ("" the top), a real directory reached without links."""
        if not rel:
            return sorted(os.listdir(self.fd))
        with self._parent(rel) as (fd, name):
            sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            try:
                return sorted(os.listdir(sub))
            finally:
                os.close(sub)

    def walk_files(self, rel: str) -> list[str]:
        """Relative paths (from the top) of the regular files and symlinks under directory ``rel``, links not followed."""
        out: list[str] = []
        for name in self.listdir(rel):
            child = f"{rel}/{name}"
            k = self.kind(child)
            if k == "dir":
                out += self.walk_files(child)
            elif k in ("file", "symlink", "other"):
                out.append(child)
        return out

    def remove_tree(self, rel: str) -> None:
        """Delete directory ``rel`` and what is in it, links removed as links (never followed)."""
        for name in self.listdir(rel):
            child = f"{rel}/{name}"
            if self.kind(child) == "dir":
                self.remove_tree(child)
            else:
                self.unlink(child)
        with self._parent(rel) as (fd, name):
            os.rmdir(name, dir_fd=fd)
