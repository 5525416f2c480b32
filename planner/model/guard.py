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
  prints the message and ends the process with exit 2 a few seconds later.

Phases are reported through the same ``progress(phase, done, total)`` callback the pipeline
already calls; a phase outside :data:`USER_PHASES` (the search, measurements) stops the clock.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import sysconfig
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

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

Progress = Callable[[str, int, int], None]


class UserCodeTimeout(BaseException):
    """Raised in the main thread when the limit passes (a BaseException: user ``except Exception`` won't eat it)."""


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
    _armed: bool = field(default=False, repr=False)
    _previous: _Handler = field(default=None, repr=False)
    #: the model's line the main thread was running when the limit passed (None: not known)
    _at: str | None = field(default=None, repr=False)

    def describe(self) -> str:
        return PHASE_WORDS.get(self.phase, self.phase)

    def wrap(self, progress: Progress | None) -> Progress:
        """A progress callback that records the phase (and stops the clock outside user code) before ``progress``."""

        def report(phase: str, done: int, total: int) -> None:
            if phase != self.phase:
                self.phase = phase
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
        self._timer = threading.Timer(self.timeout_s + WATCHDOG_GRACE_S, self._watchdog)
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        if not self._armed:
            return
        self._armed = False
        if _can_alarm():
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous if self._previous is not None else signal.SIG_DFL)
        if self._timer is not None:
            self._timer.cancel()

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
            sys.stderr.write(f"error: {e.message}\n{e.hint}\n")
            sys.stderr.flush()
        finally:
            _REAL_EXIT(2)


_REAL_EXIT = os._exit


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

    os._exit = fake_exit  # type: ignore[assignment]
    g.arm()
    try:
        yield g
    except UserCodeTimeout:
        raise g.timeout_error() from None
    except UserCodeExit as e:
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
    finally:
        g.disarm()
        os._exit = _REAL_EXIT


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
