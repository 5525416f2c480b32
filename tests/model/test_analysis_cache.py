"""The analysis cache (planner.model.cache): a hit gives the plan a miss gives, byte for byte, and anything the
analysis depends on invalidates it.

Reference: the plan directory made with the cache off (PLANNER_CACHE=off), compared file by file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from planner.model import cache

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.fixture
def cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_CACHE", "on")
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "analyses"


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _plan(model: str, out: Path, *extra: str) -> None:
    r = runner.invoke(app, ["plan", model, "--gpus", "16xH100", "--engine", "megatron", "--out", str(out), "--quiet", *extra])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("model", [str(ROOT / "examples" / "llama.py"), f"hf:{ROOT / 'tests' / 'models' / 'hf' / 'phi3.json'}"])
def test_a_plan_from_the_cache_is_byte_identical_to_one_without_it(cached, tmp_path, monkeypatch, model):
    args = ["--model-arg", "preset=llama-tiny"] if model.endswith(".py") else []
    _plan(model, tmp_path / "miss", *args)
    assert len(list(cached.glob("*.json"))) == 1
    calls = []
    import planner.planning as planning

    real = planning.analyze_model
    monkeypatch.setattr(planning, "analyze_model", lambda *a, **k: calls.append(1) or real(*a, **k))
    _plan(model, tmp_path / "hit", *args)
    assert calls == []  # the second plan did not analyse the model
    _plan(model, tmp_path / "off", *args, "--no-cache")
    assert calls == [1]
    monkeypatch.setenv("PLANNER_CACHE", "off")
    _plan(model, tmp_path / "env-off", *args)
    assert calls == [1, 1]
    reference = _files(tmp_path / "off")
    for d in ("miss", "hit", "env-off"):
        assert _files(tmp_path / d) == reference, d


def test_costs_round_trip_exactly_through_their_json_form():
    from planner.model.analyze import analyze
    from planner.records import ModelCosts

    for model, args in ((ROOT / "tests" / "models" / "clip_style.py", None), (ROOT / "examples" / "moe.py", {"preset": "moe-tiny"})):
        costs = analyze(model, args).costs
        assert ModelCosts.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs


def test_an_edited_model_file_or_a_module_it_imports_is_a_miss(cached, tmp_path):
    (tmp_path / "helper.py").write_text("WIDTH = 16\n")
    model = tmp_path / "m.py"
    model.write_text(
        "import torch, torch.nn as nn\nfrom helper import WIDTH\n"
        "def build_model(): return nn.Sequential(nn.Linear(8, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 4))\n"
        "def example_inputs(b): return (torch.randn(b, 8),)\n"
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        from planner.planning import summarize_model

        first = summarize_model(str(model), {}, 1, "bf16", [], "auto")
        assert cache.load(cache.cache_key(str(model), {}, 1, "bf16", [], "auto", True)) == first
        (tmp_path / "helper.py").write_text("WIDTH = 32\n")
        sys.modules.pop("helper", None)
        second = summarize_model(str(model), {}, 1, "bf16", [], "auto")
        assert second.costs.total_params != first.costs.total_params  # the helper's edit was seen
        model.write_text(model.read_text() + "# an edit\n")
        third = summarize_model(str(model), {}, 1, "bf16", [], "auto")
        assert third.sha256 != second.sha256
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("helper", None)


def test_a_damaged_or_unwritable_cache_is_a_miss_not_an_error(cached, tmp_path):
    model = str(ROOT / "tests" / "models" / "clip_style.py")
    from planner.planning import summarize_model

    first = summarize_model(model, {}, 1, "bf16", [], "auto")
    (entry,) = cached.glob("*.json")
    entry.write_text('{"format": 1, "summary": {"costs": ')
    assert summarize_model(model, {}, 1, "bf16", [], "auto") == first
    entry.write_text(json.dumps({"format": 1, "summary": {}, "deps": {"files": {"/nonexistent.py": "0" * 64}}}))
    assert summarize_model(model, {}, 1, "bf16", [], "auto") == first
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    os.environ["PLANNER_CACHE_DIR"] = str(blocked)  # the fixture's monkeypatch restores it
    assert summarize_model(model, {}, 1, "fp32", [], "auto").costs.total_params == first.costs.total_params
    assert blocked.read_text() == "not a folder"


def test_an_edited_file_the_build_reads_is_a_miss(cached, tmp_path):
    """A model file whose build reads its sizes from a JSON file beside it: editing the JSON file changes the model,
    and the cache sees it (the files the analysis opened are checked on every hit)."""
    from planner.planning import summarize_model

    sizes = tmp_path / "sizes.json"
    sizes.write_text('{"width": 16}')
    model = tmp_path / "m.py"
    model.write_text(
        "import json, pathlib, torch, torch.nn as nn\n"
        "def build_model():\n"
        "    w = json.loads((pathlib.Path(__file__).parent / 'sizes.json').read_text())['width']\n"
        "    return nn.Sequential(nn.Linear(8, w), nn.ReLU(), nn.Linear(w, 4))\n"
        "def example_inputs(b): return (torch.randn(b, 8),)\n"
    )
    first = summarize_model(str(model), {}, 1, "bf16", [], "auto")
    assert summarize_model(str(model), {}, 1, "bf16", [], "auto") == first
    sizes.write_text('{"width": 32}')
    second = summarize_model(str(model), {}, 1, "bf16", [], "auto")
    assert (first.costs.total_params, second.costs.total_params) == (8 * 16 + 16 + 16 * 4 + 4, 8 * 32 + 32 + 32 * 4 + 4)


def test_a_plan_from_the_cache_never_imports_torch(tmp_path):
    """A hit needs no model code: the whole command, run as a user runs it, imports torch only on a miss (torch's import
    is about 2 s of a warm plan on a 2-core machine). Reference: Python's own import log (-X importtime)."""
    import subprocess
    import sys

    env = {**os.environ, "PLANNER_CACHE": "on", "PLANNER_CACHE_DIR": str(tmp_path / "cache")}
    base = [sys.executable, "-X", "importtime", "-m", "planner", "plan", str(ROOT / "examples" / "llama.py"), "--model-arg", "preset=llama-tiny"]
    base += ["--gpus", "16xH100", "--engine", "megatron", "--quiet"]

    def torch_imported(out: str) -> bool:
        proc = subprocess.run([*base, "--out", str(tmp_path / out)], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in proc.stderr.splitlines() if line.startswith("import time:"))

    assert torch_imported("miss")  # the reference holds: the log names torch when the model is analysed
    assert not torch_imported("hit")
