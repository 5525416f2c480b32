"""Mixture-of-experts models trained for real on 2 CPU ranks (gloo) equal one process (`planner smoke`).

examples/moe.py's dropless grouped-GEMM routing (Mixtral-style softmax router; DeepSeek-style MLA, sigmoid router,
shared expert and a dense first layer) and transformers' Mixtral, pipelined across two stages with the cut inside
the decoder layers, so routed activations cross ranks. 10-20 s per run on 2 cores.
"""

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def _plan(tmp_path: Path, model: str, engine: str, *args: str) -> Path:
    out = tmp_path / "plan"
    r = runner.invoke(app, ["plan", model, *args, "--gpus", "2xcpu", "--engine", engine, "--pp", "2", "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    return out


def _smoke(d: Path) -> dict:
    r = runner.invoke(app, ["smoke", str(d), "--steps", "2"])
    assert r.exit_code == 0, r.output
    return json.loads((d / "smoke.json").read_text())


RUNS = [
    pytest.param(str(ROOT / "examples/moe.py"), ("--model-arg", "preset=moe-tiny"), "torch", id="mixtral-style-torch"),
    pytest.param(str(ROOT / "examples/moe.py"), ("--model-arg", "preset=deepseek-tiny"), "torch", id="deepseek-style-torch"),
    pytest.param(f"hf:{ROOT / 'tests/models/hf/mixtral.json'}", (), "torch", id="hf-mixtral-torch", marks=pytest.mark.slow),
    pytest.param(str(ROOT / "examples/moe.py"), ("--model-arg", "preset=deepseek-tiny"), "deepspeed", id="deepseek-style-deepspeed", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("model, args, engine", RUNS)
def test_moe_pipeline_on_two_ranks_equals_one_process(tmp_path, model, args, engine):
    d = _plan(tmp_path, model, engine, *args)
    plan = json.loads((d / "plan.json").read_text())
    assert len(plan["stages"]) >= 2
    doc = _smoke(d)
    assert doc["ok"] and doc["ranks"] == 2 and doc["layout"]["pp"] == 2
    assert doc["max_relative_difference"] <= 1e-5
    assert len(doc["losses"]) == 2 and doc["losses"] == pytest.approx(doc["reference_losses"], rel=1e-5)
    assert all(math.isfinite(x) for x in doc["losses"]) and doc["losses"][0] != doc["losses"][1]
