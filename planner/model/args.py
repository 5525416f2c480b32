"""The model's ``--model-arg KEY=VALUE`` arguments, parsed without torch (a plan from the cache of analysed models
never imports it)."""

from __future__ import annotations

import ast
from typing import Any

from planner.errors import UsageError

__all__ = ["parse_model_args"]


def parse_model_args(pairs: list[str] | None) -> dict[str, Any]:
    """Parse ``KEY=VALUE`` strings; values are Python literals when they parse as one, else strings."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise UsageError(
                f"--model-arg {pair!r} is not KEY=VALUE.",
                "Write it as e.g. --model-arg preset=llama-70b --model-arg seq_len=4096.",
            )
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = {"true": True, "false": False, "none": None}.get(raw.lower(), raw)
        out[key] = value
    return out
