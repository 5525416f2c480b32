"""Shared fixtures: model costs are traced once per test session (tracing a 7B model takes seconds)."""

from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


@cache
def costs_of(example: str, preset: str, micro_batch: int = 1, dtype: str = "bf16", **extra):
    """ModelCosts of examples/<example>.py with ``preset`` (cached for the session)."""
    from planner.model.analyze import analyze

    args = {"preset": preset, **extra}
    return analyze(EXAMPLES / f"{example}.py", args, micro_batch, dtype).costs


@pytest.fixture(scope="session")
def llama7b():
    return costs_of("llama", "llama-7b")


@pytest.fixture(scope="session")
def gpt2xl():
    return costs_of("gpt2", "gpt2-xl")
