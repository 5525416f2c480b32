"""A sandbox for running a script the planner did not write: no network, a read-only view of every file system but
the run's own temporary directory, its own process tree.

Linux's unprivileged namespaces (util-linux ``unshare``: a user namespace mapping the caller to root in it, new
network, mount and PID namespaces) give it without privileges: the root file system is bind-mounted onto an empty
directory, every mount under it remounted read-only, the run's directory bound back writable, and the command runs
chrooted there. The PID namespace ends every process the script left behind when it exits. Where the platform has no
``unshare`` or refuses the namespaces (macOS, containers without user namespaces), :func:`available` says why and the
caller says it ran without one.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

#: the setup run inside the namespaces (as root of the user namespace), before the command; $1 the new root, $2 the
#: writable directory, the rest the command
_SETUP = r"""set -e
root=$1; keep=$2; cwd=$3; shift 3
{mount} --rbind / "$root"
{findmnt} -R -n -l -o TARGET "$root" | {sort} -r | while IFS= read -r m; do {mount} -o remount,bind,ro "$m" 2>/dev/null || :; done
{mount} --bind "$keep" "$root$keep"
{mount} -t proc proc "$root/proc" 2>/dev/null || :
exec {chroot} "$root" {env} -C "$cwd" "$@"
"""
#: where the setup's tools are looked for (the caller's PATH is not the script's)
_SYSTEM = "/usr/sbin:/usr/bin:/sbin:/bin"


def _tools() -> dict[str, str] | None:
    found = {name: shutil.which(name, path=_SYSTEM) for name in ("mount", "findmnt", "sort", "chroot", "env")}
    return None if any(v is None for v in found.values()) else {k: str(v) for k, v in found.items()}


def _unshare() -> list[str] | None:
    tool = shutil.which("unshare", path=_SYSTEM)
    return None if tool is None else [tool, "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child"]


@functools.cache
def available() -> str | None:
    """None when the sandbox works on this machine, else why not (one sentence)."""
    cmd = _unshare()
    if cmd is None or _tools() is None:
        return "util-linux's unshare, mount, findmnt and coreutils' chroot are not all installed"
    try:
        done = subprocess.run([*cmd, "true"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare could not start ({e})"
    if done.returncode != 0:
        return "the system refuses unprivileged user, network and mount namespaces (" + done.stderr.decode(errors="replace").strip()[:120] + ")"
    return None


def wrap(command: Sequence[str], writable: Path, cwd: Path) -> list[str]:
    """``command`` to run inside the sandbox in directory ``cwd``, with ``writable`` (an absolute directory, made
    beforehand) the one place it can write; call only when :func:`available` is None. ``writable`` holds the new
    root's mount point."""
    cmd = _unshare()
    assert cmd is not None
    root = writable / ".sandbox-root"
    root.mkdir(exist_ok=True)
    setup = writable / ".sandbox-setup.sh"
    tools = _tools()
    assert tools is not None
    setup.write_text(_SETUP.format(**tools))
    return [*cmd, "/bin/sh", str(setup), str(root), str(writable), str(cwd), *command]
