"""Shared fixtures: model costs are traced once per test session (tracing a 7B model takes seconds)."""

import os
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the cache of analysed models (planner.model.cache) is off in the tests, and in the commands they run: a test that
# changes how a model is costed must not read an earlier test's costs; tests/model/test_analysis_cache.py turns it on
os.environ["PLANNER_CACHE"] = "off"
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


#: a small residual MLP model file, ``{prelude}`` and ``{build}`` filled in by the tests (hardening, plan directories)
TINY_MODEL = """
import torch
import torch.nn as nn
{prelude}

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d) for _ in range(n)])
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        return self.head(self.blocks(x))


def build_model(dim=64, layers=4, note=""):
    {build}
    return Net(dim, layers)


def example_inputs(batch_size, dim=64, note=""):
    return (torch.randn(batch_size, dim),)
"""


def model_file(tmp: Path, name: str = "model.py", prelude: str = "", build: str = "pass") -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    p = tmp / name
    p.write_text(TINY_MODEL.format(prelude=prelude, build=build))
    return p


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    """One real plan of the tiny model (deepspeed, 2 GPUs) and its model file."""
    from planner.planning import plan_model
    from planner.solve.settings import Settings

    d = tmp_path_factory.mktemp("model")
    m = model_file(d)
    plan, _, _ = plan_model(Settings.of(model_file=str(m), model_args={}, gpus="2xA100", engine="deepspeed", pp=2))
    return plan, m


def derived_architecture(spec: str, args: dict | None = None):
    """architecture() as planning derives it for a library spec (planner.engines.megatron.hf_shapes on the built model's
    transformers config, for a causal LM), else None."""
    import torch

    from planner.engines.megatron.hf_shapes import hf_architecture
    from planner.model.load import load_model_file
    from planner.model.sources import hf_seq_len, transformers_config

    mf = load_model_file(spec, dict(args or {}))
    found = transformers_config(mf.build_meta(torch.bfloat16))
    if found is None or not found[1]:
        return None
    return hf_architecture(found[0], hf_seq_len(found[0], (args or {}).get("seq_len")))
