"""One validation layer for command-line values: ranges, finite numbers and closed sets.

Each check returns the value or raises :class:`~planner.errors.UsageError` (exit 2) saying
what is accepted. A 0 or a negative is refused wherever it means nothing (``--pp 0`` is an
error, never "unset"). The limits bound the work one command can ask for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TypeVar

from planner.engines import ENGINES, get_engine
from planner.errors import UsageError, did_you_mean

T = TypeVar("T")

#: largest value any layout dimension pin may take (pp, tp, dp, vp, micro-batch)
MAX_DEGREE = 1 << 16
#: largest --global-batch (samples per optimizer step); larger ones are not a training run
MAX_GLOBAL_BATCH = 1 << 24
#: largest --timeout (seconds)
MAX_TIMEOUT_S = 7 * 24 * 3600.0
#: closed sets (the engine's schedules, recomputation modes and ZeRO stages come from planner.engines)
DTYPES = ("bf16", "fp16", "fp32")
#: `plan` also takes fp8: Transformer Engine FP8 GEMMs on bf16 weights and activations (where the GPU has an FP8 peak)
PLAN_DTYPES = (*DTYPES, "fp8")
TRACERS = ("auto", "fx", "export")
VALIDATE_FORMATS = ("text", "json", "github")
SMOKE_DEVICES = ("auto", "cpu", "cuda")
PROFILE_DEVICES = ("cuda", "cpu")


def choice(flag: str, value: T | None, choices: Iterable[T]) -> T | None:
    """``value`` when it is one of ``choices`` (or None: not given), else exit 2 listing them."""
    choices = tuple(choices)
    if value is None or value in choices:
        return value
    listed = ", ".join(str(c) for c in choices)
    raise UsageError(
        f"{flag} {value!r} is not accepted.{did_you_mean(str(value), [str(c) for c in choices])}",
        f"Accepted: {listed}.",
    )


def positive_int(flag: str, value: int | None, upper: int = MAX_DEGREE) -> int | None:
    """A whole number in [1, ``upper``], or None (not given)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= upper:
        raise UsageError(
            f"{flag} must be a whole number from 1 to {upper:,}, got {value!r}.",
            "Leave the flag out to let the planner choose." if upper == MAX_DEGREE else None,
        )
    return value


def non_negative_int(flag: str, value: int | None, upper: int) -> int | None:
    """A whole number in [0, ``upper``], or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= upper:
        raise UsageError(f"{flag} must be a whole number from 0 to {upper:,}, got {value!r}.")
    return value


def finite_number(flag: str, value: float | None, low: float, high: float, low_open: bool = True) -> float | None:
    """A finite number in (``low``, ``high``] (or [``low``, ``high``] with ``low_open=False``), or None."""
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise UsageError(f"{flag} must be a finite number in {bracket}{low:g}, {high:g}], got {value!r}.")
    return float(value)


def recompute_modules(values: Iterable[str] | None, recompute: str | None, engine: str) -> tuple[str, ...]:
    """``--recompute-modules`` (comma-separated or repeated) as a tuple in the order given: module names of the engine's
    own option (Engine.recompute_module_names) that the planner models (Engine.recompute_modules), for an engine that
    has the option and selective recomputation (``--recompute`` unpinned or selective). () when not given. Exit 2
    otherwise."""
    names = tuple(n.strip() for v in values or () for n in v.split(",") if n.strip())
    if not names:
        return ()
    rules = get_engine(engine)
    if not rules.recompute_modules:
        owners = " / ".join(s.rules.title for s in ENGINES.values() if s.rules.recompute_modules)
        raise UsageError(
            f"--recompute-modules is a {owners} option; engine {engine} recomputes the attention core only.",
            f"Use {rules.alternative(lambda e: bool(e.recompute_modules))}, or drop it.",
        )
    known, modelled = rules.recompute_module_names, rules.recompute_modules
    for n in names:
        if n not in known:
            raise UsageError(f"--recompute-modules {n!r} is not one of {rules.title}'s.{did_you_mean(n, list(known))}", f"Accepted: {', '.join(modelled)}.")
        if n not in modelled:
            raise UsageError(
                f"--recompute-modules {n}: the planner does not model what recomputing {n} keeps and costs.",
                f"Use {', '.join(modelled)}, or plan without {n} (its memory is then overstated).",
            )
    if len(set(names)) != len(names):
        raise UsageError(f"--recompute-modules names a module twice: {', '.join(names)}.", "Name each module once.")
    if recompute not in (None, "selective"):
        raise UsageError(
            f"--recompute-modules chooses what selective recomputation recomputes; got --recompute {recompute}.",
            "Use --recompute selective, or drop --recompute-modules.",
        )
    return names


def fp8_param_gather(on: bool, dtype: str, engine: str, zero: int | None) -> None:
    """``--fp8-param-gather`` only where Megatron runs it: FP8 training (``--dtype fp8``), ``--engine megatron`` and the
    distributed optimizer (validate_args asserts it; a pinned ``--zero 0`` cannot have it). Exit 2 otherwise."""
    if not on:
        return
    if dtype != "fp8":
        raise UsageError(
            f"--fp8-param-gather keeps the weights in FP8, which needs FP8 training; got --dtype {dtype}.", "Add --dtype fp8, or drop --fp8-param-gather."
        )
    rules = get_engine(engine)
    if not rules.fp8_primary_weights:
        owners = " / ".join(s.rules.title for s in ENGINES.values() if s.rules.fp8_primary_weights)
        raise UsageError(
            f"--fp8-param-gather is a {owners} option; engine {engine} has no FP8 primary weights.",
            f"Use {rules.alternative(lambda e: e.fp8_primary_weights)}, or drop --fp8-param-gather.",
        )
    if zero == 0:
        raise UsageError(
            "--fp8-param-gather needs Megatron's distributed optimizer; --zero 0 pins it off.",
            "Use --zero 1 (or leave --zero out), or drop --fp8-param-gather.",
        )
