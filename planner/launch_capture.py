"""Run a launch script under bash with stub launchers and capture what it would launch.

The script runs for real under ``bash`` (so ``if``/``else``, functions, arrays, ``$(...)``,
here-documents, ``source`` and loops mean what bash makes of them), but every launcher it
could call (:data:`STUBS`: torchrun, srun, deepspeed, python, python3, mpirun) is a stub
first on PATH that records its argv (NUL-separated) and its environment, then exits 0: the
real programs are never run, and nothing the stubs are given is executed.

Bounds: a temporary directory as working directory, HOME and TMPDIR; a clean environment
(PATH = stubs + the system directories, nothing of the caller's); stdin from /dev/null; a
wall-clock timeout after which the whole process group is killed; a CPU-time, file-size
and address-space limit (a script that loops or doubles a string forever is stopped);
stdout/stderr to files of bounded size, of which only the tail is read. bash's own xtrace
(``BASH_ENV`` turns it on, to a file of its own) says which line ran each command.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from planner import sandbox

STUBS = ("torchrun", "srun", "deepspeed", "python", "python3", "mpirun")
#: empty files in the working directory, for scripts that check that Megatron-LM is there before launching
PLACEHOLDERS = ("pretrain_gpt.py", "Megatron-LM/pretrain_gpt.py")
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
TIMEOUT_S = 10.0
MAX_FILE_BYTES = 4 * 1024 * 1024  # RLIMIT_FSIZE: any file the script writes, its output included
MAX_MEMORY_BYTES = 1024 * 1024 * 1024  # RLIMIT_AS of bash and what it starts
TAIL_BYTES = 2000

# Sourced by every bash started (BASH_ENV), stubs excepted: bash's own xtrace, with the file and line of each command, to a file.
_TRACE = r"""case "$0" in "$PLANNER_STUB_DIR"/*) return 0 ;; esac
PS4='+${BASH_SOURCE[0]:-$0}:${LINENO}|'
exec {PLANNER_TRACE_FD}>>"$PLANNER_TRACE_FILE"
BASH_XTRACEFD=$PLANNER_TRACE_FD
set -x
"""

# $0 is the stub's own path; $STUB_NAME its name. One file pair per call, named by time and pid so they sort in call order.
_STUB = r"""#!{bash}
f="$PLANNER_CAPTURE_DIR/${{EPOCHREALTIME/[.,]/}}-$$"
printf '%s\0' "{name}" "$@" > "$f.argv"
for n in $(compgen -e); do printf '%s=%s\0' "$n" "${{!n}}"; done > "$f.env"
exit 0
"""


@dataclass(frozen=True)
class Call:
    """One call of a stub launcher: its argv (argv[0] the launcher's name) and the environment it was given."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Capture:
    """What running the script showed: the launcher calls in order, how it ended, and its stderr's tail."""

    calls: tuple[Call, ...]
    returncode: int | None  # None when it was killed at the timeout
    timed_out: bool
    stderr_tail: str
    limit_hit: str | None = None  # which resource limit stopped it, if one did
    trace: tuple[tuple[str, int, str], ...] = ()
    timeout: float = TIMEOUT_S  # bash's xtrace: (file, last line of the command, the command as bash ran it)
    #: how the launches were found: "run" (bash with stub launchers, in the sandbox where the platform has one),
    #: "run, no sandbox: WHY", or "read" (read statically, nothing run: planner.script_static)
    how: str = "run"

    @property
    def stopped(self) -> str | None:
        """Why the script did not finish normally, in a sentence; None when it exited 0."""
        tail = f" Its last output: {self.stderr_tail.strip()!r}." if self.stderr_tail.strip() else ""
        if self.timed_out:
            return f"the script ran past {self.timeout:g} s under bash (a loop that never ends, or a command waiting for something) and was stopped.{tail}"
        if self.limit_hit:
            return f"the script was stopped by the {self.limit_hit} limit ({_LIMITS[self.limit_hit]}; a loop that never ends, or a value that keeps doubling?).{tail}"
        if self.returncode:
            return f"the script exited with status {self.returncode} before it was done.{tail}"
        return None


def _limits() -> None:  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_AS, (MAX_MEMORY_BYTES, MAX_MEMORY_BYTES))
    cpu = int(TIMEOUT_S) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _read_calls(capture_dir: Path) -> list[Call]:
    calls = []
    for argv_file in sorted(capture_dir.glob("*.argv"), key=lambda p: tuple(int(x) for x in p.stem.split("-"))):
        argv = argv_file.read_bytes().decode("utf-8", "replace").split("\0")[:-1]
        env_file = argv_file.with_suffix(".env")
        pairs = env_file.read_bytes().decode("utf-8", "replace").split("\0")[:-1] if env_file.is_file() else []
        env = dict(p.split("=", 1) for p in pairs if "=" in p)
        if argv:
            calls.append(Call(tuple(argv), env))
    return calls


_LIMITS = {
    "file size": f"a file it wrote, its output or bash's trace of its commands passed {MAX_FILE_BYTES // 2**20} MiB",
    "CPU time": f"it computed for more than {int(TIMEOUT_S) + 1} s",
    "memory": f"bash needed more than {MAX_MEMORY_BYTES // 2**30} GiB",
}
_TRACE_LINE = re.compile(r"^\++(.*?):(\d+)\|(.*)$")


def _read_trace(path: Path) -> list[tuple[str, int, str]]:
    out: list[tuple[str, int, str]] = []
    if not path.is_file():
        return out
    for raw in path.read_bytes().decode("utf-8", "replace").splitlines():
        m = _TRACE_LINE.match(raw)
        if m:
            out.append((m.group(1), int(m.group(2)), m.group(3)))
        elif out:  # a value with a newline in it
            f, n, t = out[-1]
            out[-1] = (f, n, t + "\n" + raw)
    return out


def _tail(path: Path) -> str:
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - TAIL_BYTES))
        return fh.read().decode("utf-8", "replace")


def run_script(script: Path | None = None, text: str | None = None, timeout: float = TIMEOUT_S) -> Capture:
    """Run ``script`` (a path: ``$0`` and ``dirname "$0"`` are its real place) or ``text`` under bash with the stubs.

    Returns the launcher calls bash made, in order. The working directory is a fresh temporary
    directory, removed afterwards with everything the script wrote there. Where the platform offers it
    (planner.sandbox) bash runs without network, in its own process tree, with every file system
    read-only but that directory; the capture's ``how`` says whether it did.
    """
    bash = shutil.which("bash") or "/bin/bash"
    with tempfile.TemporaryDirectory(prefix="planner-launch-") as tmp:
        root = Path(tmp)
        stubs, capture, work = root / "bin", root / "capture", root / "work"
        for d in (stubs, capture, work, work / "Megatron-LM"):
            d.mkdir()
        for placeholder in PLACEHOLDERS:  # existence checks (`[[ -f .../pretrain_gpt.py ]]`) pass; never run
            (work / placeholder).write_text("")
        for name in STUBS:
            stub = stubs / name
            stub.write_text(_STUB.format(bash=bash, name=name))
            stub.chmod(0o755)
        if script is None:
            script = root / "script.sh"
            script.write_text(text or "")
        (root / "trace.sh").write_text(_TRACE)
        env = {
            "PATH": f"{stubs}:{SYSTEM_PATH}",
            "HOME": str(work),
            "TMPDIR": str(work),
            "LC_ALL": "C",
            "BASH_ENV": str(root / "trace.sh"),
            "PLANNER_CAPTURE_DIR": str(capture),
            "PLANNER_STUB_DIR": str(stubs),
            "PLANNER_TRACE_FILE": str(root / "trace"),
        }
        out, err = root / "stdout", root / "stderr"
        command = [bash, "--norc", "--noprofile", str(script)]
        why_not = sandbox.available()
        how = "run" if why_not is None else f"run, no sandbox: {why_not}"
        if why_not is None:
            command = sandbox.wrap(command, root, work)
        with open(out, "wb") as so, open(err, "wb") as se:
            proc = subprocess.Popen(
                command,
                cwd=work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=so,
                stderr=se,
                start_new_session=True,
                preexec_fn=_limits,
            )
            timed_out = False
            try:
                code: int | None = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out, code = True, None
            try:  # the script's leftovers (background jobs) go with it
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if timed_out:
                proc.wait()
        limit = None
        if code is not None and code < 0:
            limit = {signal.SIGXFSZ: "file size", signal.SIGXCPU: "CPU time", signal.SIGKILL: "memory", signal.SIGSEGV: "memory"}.get(signal.Signals(-code))
        elif code in (128 + signal.SIGXFSZ, 128 + signal.SIGXCPU):
            limit = "file size" if code == 128 + signal.SIGXFSZ else "CPU time"
        stderr = _tail(err)
        if limit is None and code and "cannot allocate" in stderr.lower():
            limit = "memory"
        return Capture(tuple(_read_calls(capture)), code, timed_out, stderr, limit, tuple(_read_trace(root / "trace")), timeout, how)
