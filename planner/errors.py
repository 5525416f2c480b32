"""Errors the CLI turns into one clear paragraph and an exit code (never a bare traceback)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class PlannerError(Exception):
    """A user-facing error: what went wrong and what to do about it.

    ``exit_code`` follows the CLI convention: 2 for bad input or usage, 1 for a
    well-formed request that has no answer (e.g. nothing fits).
    """

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n{self.hint}"


class UsageError(PlannerError):
    """Bad input: a missing file, an unknown name, a malformed flag (exit 2)."""


class InfeasibleError(PlannerError):
    """The request is well formed but no plan satisfies it (exit 1)."""

    exit_code = 1


def close_matches(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """Closest names to ``word`` among ``choices``, case-insensitively, best first."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    hits = difflib.get_close_matches(word.lower(), list(lowered), n=n, cutoff=0.5)
    if not hits:  # substring matches help with partial names such as "a100"
        hits = [c for c in lowered if word.lower() in c][:n]
    return [lowered[h] for h in hits]


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """A ' Did you mean X?' suffix, or '' when nothing is close."""
    hits = close_matches(word, choices)
    if not hits:
        return ""
    return " Did you mean " + " or ".join(repr(h) for h in hits) + "?"
