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
root=$1; keep=$2; shift 2
mount --rbind / "$root"
findmnt -R -n -l -o TARGET "$root" | sort -r | while IFS= read -r m; do mount -o remount,bind,ro "$m" 2>/dev/null || :; done
mount --bind "$keep" "$root$keep"
mount -t proc proc "$root/proc" 2>/dev/null || :
cd "$root$keep"
exec chroot "$root" /usr/bin/env -C "$keep" "$@"
"""


def _unshare() -> list[str] | None:
    tool = shutil.which("unshare")
    return None if tool is None else [tool, "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child"]


@functools.cache
def available() -> str | None:
    """None when the sandbox works on this machine, else why not (one sentence)."""
    cmd = _unshare()
    if cmd is None or shutil.which("findmnt") is None or shutil.which("chroot") is None:
        return "util-linux's unshare, findmnt and chroot are not all installed"
    try:
        done = subprocess.run([*cmd, "true"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare could not start ({e})"
    if done.returncode != 0:
        return "the system refuses unprivileged user, network and mount namespaces (" + done.stderr.decode(errors="replace").strip()[:120] + ")"
    return None


def wrap(command: Sequence[str], writable: Path) -> list[str]:
    """``command`` to run inside the sandbox, with ``writable`` (an absolute directory, made beforehand) the one
    place it can write; call only when :func:`available` is None. ``writable`` holds the new root's mount point."""
    cmd = _unshare()
    assert cmd is not None
    root = writable / ".sandbox-root"
    root.mkdir(exist_ok=True)
    setup = writable / ".sandbox-setup.sh"
    setup.write_text(_SETUP)
    return [*cmd, "/bin/sh", str(setup), str(root), str(writable), *command]
