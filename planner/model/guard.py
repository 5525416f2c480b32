"""Run a user's model file under a guard: exits, interrupts and hangs become one clear error.

User code (importing the model file, ``build_model()``, tracing and costing) may call
``sys.exit``, raise ``KeyboardInterrupt``, call ``os._exit`` or never return.  Inside
:func:`guard_user_code`:

- ``SystemExit`` and ``KeyboardInterrupt`` become a :class:`~planner.errors.UsageError` (exit 2)
  naming the phase;
- ``os._exit`` is replaced, for this process only, by a function that raises the same error, so
  the planner survives it (a forked child still exits for real).  ``os.kill(os.getpid(), SIGKILL)``
  cannot be survived in-process; it is not guarded;
- a time limit (seconds) covers the user-code phases (import, build, trace, cost): SIGALRM raises
  in the main thread, and should the code sit in C without returning to Python, a watchdog thread
  prints the message and ends the process with exit 2 a few seconds later; should the code hold the
  interpreter's lock all along (a C loop that never releases it), a watchdog process outside the
  interpreter prints the message and sends SIGINT, whose handler for the guard's span is libc's
  ``_exit`` (so the status is the signal's number, 2) a few seconds after that.

Phases are reported through the same ``progress(phase, done, total)`` callback the pipeline
already calls; a phase outside :data:`USER_PHASES` (the search, measurements) stops the clock.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import signal
import subprocess
import sys
import sysconfig
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from planner.errors import UsageError

#: what signal.signal takes and returns: a handler, SIG_DFL / SIG_IGN, or None (installed from outside Python)
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None

#: phases in which user code runs and the time limit applies
USER_PHASES = {"import": "importing", "build": "building", "trace": "tracing", "cost": "costing"}
#: how other phases read in messages
PHASE_WORDS = {**USER_PHASES, "model": "loading or checking", "smoke run": "running"}
#: default limit for `--timeout`, seconds
DEFAULT_TIMEOUT_S = 300.0
#: seconds the watchdog waits after the limit before ending a process stuck outside Python
WATCHDOG_GRACE_S = 5.0
#: seconds after the watchdog thread's turn when the watchdog process ends a process whose code holds the GIL
OUTSIDE_GRACE_S = 5.0

Progress = Callable[[str, int, int], None]


class UserCodeTimeout(BaseException):
    """Raised in the main thread when the limit passes (a BaseException: user ``except Exception`` won't eat it)."""


class Terminated(BaseException):
    """Raised in the main thread when the process receives SIGTERM (installed by the CLI's entry point)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class UserCodeExit(BaseException):
    """Raised in place of ``os._exit`` inside the guard."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


@dataclass
class Guard:
    """The running guard: what file runs, the current phase and the limit (seconds; None: none)."""

    what: str
    timeout_s: float | None
    phase: str = "import"
    _timer: threading.Timer | None = field(default=None, repr=False)
    _outside: _OutsideWatchdog | None = field(default=None, repr=False)
    _stderr_fd: int | None = field(default=None, repr=False)
    _armed: bool = field(default=False, repr=False)
    _previous: _Handler = field(default=None, repr=False)
    #: the model's line the main thread was running when the limit passed (None: not known)
    _at: str | None = field(default=None, repr=False)
    #: the working directory when the guard began: put back whenever user code has changed it (relative paths the
    #: command was given keep their meaning)
    cwd: str = field(default_factory=os.getcwd, repr=False)

    def restore_cwd(self) -> None:
        try:
            if os.getcwd() != self.cwd:
                os.chdir(self.cwd)
        except OSError:  # the directory was removed under us: keep the one we are in
            pass

    def describe(self) -> str:
        return PHASE_WORDS.get(self.phase, self.phase)

    def wrap(self, progress: Progress | None) -> Progress:
        """A progress callback that records the phase (and stops the clock outside user code) before ``progress``."""

        def report(phase: str, done: int, total: int) -> None:
            if phase != self.phase:
                self.phase = phase
                self.restore_cwd()
                if phase not in USER_PHASES:
                    self.disarm()
            if progress is not None:
                progress(phase, done, total)

        return report

    def timeout_error(self) -> UsageError:
        at = f" It was at {self._at} when the limit passed." if self._at else ""
        if self.phase == "trace" and self._at:
            hint = (
                "Tracing records every operator the forward runs: a Python loop in it (over the tokens of the sequence, "
                "or over chunks of it) records each of its steps, so the trace grows with the loop's length. Raise the "
                "limit with --timeout SECONDS (0: no limit), or fix the model file if that line never ends."
            )
        else:
            hint = (
                "The model file (its import, build_model(), example_inputs() or forward) may hang or be very slow; "
                "fix it, or raise the limit with --timeout SECONDS."
            )
        return UsageError(f"{self.what} did not finish {self.describe()} within {self.timeout_s:g} s.{at}", hint)

    def arm(self) -> None:
        if self.timeout_s is None or self.timeout_s <= 0:
            return
        self._armed = True
        if _can_alarm():
            self._previous = signal.signal(signal.SIGALRM, self._on_alarm)
            signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
        try:
            self._stderr_fd = os.dup(2)
        except OSError:
            self._stderr_fd = None
        self._timer = threading.Timer(self.timeout_s + WATCHDOG_GRACE_S, self._watchdog)
        self._timer.daemon = True
        self._timer.start()
        if _can_alarm():
            e = UsageError(
                f"{self.what} did not finish within {self.timeout_s:g} s, and its code held the interpreter (a loop in C that never returned to Python).",
                "Raise the limit with --timeout SECONDS (0: no limit), or fix the model file.",
            )
            self._outside = _OutsideWatchdog.start(self.timeout_s + WATCHDOG_GRACE_S + OUTSIDE_GRACE_S, f"error: {e.message}\n{e.hint}")

    def disarm(self) -> None:
        if not self._armed:
            return
        self._armed = False
        if _can_alarm():
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous if self._previous is not None else signal.SIG_DFL)
        if self._timer is not None:
            self._timer.cancel()
        if self._outside is not None:
            self._outside.stop()
            self._outside = None
        if self._stderr_fd is not None:
            try:
                os.close(self._stderr_fd)
            except OSError:
                pass
            self._stderr_fd = None

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        if self._armed:
            self._at = model_line(traceback.extract_stack(frame)) if frame is not None else None
            raise UserCodeTimeout()

    def _watchdog(self) -> None:
        """The code did not return to Python after SIGALRM: report and end the process (exit 2)."""
        if not self._armed:
            return
        e = self.timeout_error()
        try:
            sys.stderr.flush()
            # the descriptor stderr had when the guard was armed (a trace may have pointed fd 2 elsewhere meanwhile)
            os.write(self._stderr_fd if self._stderr_fd is not None else 2, f"error: {e.message}\n{e.hint}\n".encode())
        except (OSError, ValueError):
            pass
        finally:
            _REAL_EXIT(2)


_REAL_EXIT = os._exit
_REAL_ABORT = os.abort

#: the shell the watchdog process runs: wait whole seconds, tell, end the planner (positional arguments: seconds,
#: message, pid). Each sleep is one second and holds none of the planner's descriptors, so when the planner ends first
#: (the shell is killed with it, PR_SET_PDEATHSIG) nothing of it outlives the planner by more than a second, and a
#: caller reading the planner's stderr to its end never waits on it.
_WATCHDOG_SH = 'n=0; while [ "$n" -lt "$1" ]; do sleep 1 </dev/null >/dev/null 2>&1 || exit 0; n=$((n + 1)); done; printf "%s\\n" "$2" >&2; kill -INT "$3"'


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    """Linux: the watchdog process is killed when the planner ends first (PR_SET_PDEATHSIG = 1), so it never signals
    a process that reused the planner's pid."""
    try:
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


@dataclass
class _OutsideWatchdog:
    """A ``/bin/sh`` process that, after ``delay_s``, writes the message and sends this process SIGINT; for its life,
    SIGINT's handler is libc's ``_exit`` itself, which needs no interpreter lock and exits with the signal's number."""

    process: subprocess.Popen[bytes]
    previous: _Handler

    @staticmethod
    def start(delay_s: float, message: str) -> _OutsideWatchdog | None:
        if int(signal.SIGINT) != 2 or not sys.platform.startswith("linux") or not os.path.exists("/bin/sh"):
            return None
        try:
            libc = ctypes.CDLL(None)
            libc.signal.restype = ctypes.c_void_p
            libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
            exit_address = ctypes.cast(libc._exit, ctypes.c_void_p).value
            previous = signal.getsignal(signal.SIGINT)
            process = subprocess.Popen(
                ["/bin/sh", "-c", _WATCHDOG_SH, "planner-watchdog", str(math.ceil(delay_s)), message, str(os.getpid())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                close_fds=True,
                start_new_session=True,  # its own group: stop() ends the shell and its sleep together
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - one ctypes call, no locks
            )
            libc.signal(int(signal.SIGINT), exit_address)
        except (OSError, AttributeError, ValueError):
            return None
        return _OutsideWatchdog(process, previous)

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        signal.signal(signal.SIGINT, self.previous if self.previous is not None else signal.default_int_handler)


def _one_line(text: str, limit: int = 500) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@functools.cache
def _not_model_prefixes() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(torch's, typer's, the planner's and its console script's directories; the standard library's; the installed
    packages') path prefixes, for :func:`_not_the_model`."""
    import torch
    import typer

    own = tuple(str(Path(f).parent) + os.sep for f in (torch.__file__ or "", typer.__file__ or "", Path(__file__).parent))
    own += (sysconfig.get_path("scripts") + os.sep,)
    stdlib = tuple(sysconfig.get_path(k) + os.sep for k in ("stdlib", "platstdlib"))
    packages = tuple(sysconfig.get_path(k) + os.sep for k in ("purelib", "platlib"))
    return own, stdlib, packages


def _not_the_model(filename: str) -> bool:
    """Whether a frame of ``filename`` is torch's, the planner's (its console script included), typer's, Python's
    standard library's or '<...>'."""
    own, stdlib, packages = _not_model_prefixes()
    return filename.startswith(("<", *own)) or (filename.startswith(stdlib) and not filename.startswith(packages))


def model_line(frames: traceback.StackSummary) -> str | None:
    """'file.py line N (function): code' of the innermost frame that is not :func:`_not_the_model`'s: the line of the
    model (its file, or the library that defines it) a stack was running; None if there is none."""
    own = [f for f in frames if not _not_the_model(f.filename)]
    if not own:
        return None
    f = own[-1]
    return f"{Path(f.filename).name} line {f.lineno} ({f.name}): {_one_line(f.line or '', 160)}"


def _can_alarm() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextmanager
def guard_user_code(what: str, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> Iterator[Guard]:
    """Run the body as user code from ``what`` (e.g. 'model.py'): see the module docstring.

    Yields the :class:`Guard`; pass ``guard.wrap(progress)`` as the pipeline's progress callback so that
    the phase is named in messages and the clock stops when user code is done.
    """
    g = Guard(what, timeout_s)
    pid = os.getpid()

    def fake_exit(code: int = 0) -> None:
        if os.getpid() != pid:  # a child the user code forked: let it go
            _REAL_EXIT(code)
        raise UserCodeExit(code)

    def fake_abort() -> NoReturn:
        if os.getpid() != pid:
            _REAL_ABORT()
        raise UserCodeExit(-int(signal.SIGABRT))

    os._exit = fake_exit  # type: ignore[assignment]
    os.abort = fake_abort
    g.arm()
    try:
        yield g
    except UserCodeTimeout:
        raise g.timeout_error() from None
    except UserCodeExit as e:
        if e.code == -int(signal.SIGABRT):
            raise UsageError(f"{what} called os.abort() while {g.describe()}.", "A model file must not end the process; remove the abort.") from None
        raise UsageError(
            f"{what} called os._exit({e.code}) while {g.describe()}.",
            "A model file must not end the process; remove the os._exit call (or guard it with if __name__ == '__main__').",
        ) from None
    except SystemExit as e:
        raise UsageError(
            f"{what} called sys.exit({e.code!r}) (SystemExit) while {g.describe()}.",
            "A model file must not end the process; remove the exit (or guard it with if __name__ == '__main__').",
        ) from None
    except (UsageError, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - user code, or torch on user code, failed in a user-code phase
        if g.phase not in USER_PHASES or os.environ.get("PLANNER_DEBUG"):
            raise
        raise UsageError(
            f"{g.describe()} {what} failed: {type(e).__name__}: {_one_line(str(e))}",
            "The model file (or torch on it) failed. If the model runs in plain PyTorch, this is a planner bug: "
            "re-run with PLANNER_DEBUG=1 for the traceback and report it.",
        ) from e
    except KeyboardInterrupt:
        raise UsageError(
            f"interrupted (KeyboardInterrupt) while {g.describe()} {what}.",
            "Nothing was written. If the model file raises KeyboardInterrupt itself, remove that.",
        ) from None
    except Terminated as e:
        raise UsageError(
            f"the process received signal {e.signum} ({signal.Signals(e.signum).name}) while {g.describe()} {what}.", "Nothing was written."
        ) from None
    except BaseException as e:  # noqa: BLE001 - GeneratorExit or the user's own BaseException subclasses, out of user code
        if g.phase not in USER_PHASES and g.phase != "model":
            raise
        raise UsageError(
            f"{g.describe()} {what} raised {type(e).__name__} (a BaseException): {_one_line(str(e))}",
            "A model file must raise Exception subclasses only; BaseException is for ending the process.",
        ) from None
    finally:
        g.disarm()
        g.restore_cwd()
        os._exit = _REAL_EXIT
        os.abort = _REAL_ABORT


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send whatever the body prints to stdout (Python and C level) to stderr, so stdout stays ours (--json)."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1 (e.g. a closed stdout): Python-level redirect only
        saved = None
    py_stdout = sys.stdout
    try:
        if saved is not None:
            os.dup2(2, 1)
        sys.stdout = sys.stderr
        yield
    finally:
        sys.stdout = py_stdout
        try:
            sys.stderr.flush()
        finally:
            if saved is not None:
                os.dup2(saved, 1)
                os.close(saved)
