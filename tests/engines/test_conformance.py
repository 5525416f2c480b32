"""The conformance kit: every engine in the registry (planner.engines.ENGINES) passes it, or declares in its spec,
with the reason, what it cannot do. A wing that is half-built (a part neither there nor declared missing) fails.

What each wing is held to, on a tiny model planned for it:
* its parts are there with the names their contract needs (planner.engines.spec.CONTRACT), or declared missing;
* its renderer writes a plan directory that ``planner validate`` passes with no error;
* the rendered plan re-prices to the same step time (planning.evaluate_pinned on plan.json's recorded inputs);
* its log reader reads its own log format (the fixtures of tests/fixtures/logs, one per engine with a reader);
* ``planner smoke`` runs it on CPU (or its own smoke checks pass, where the engine cannot train on CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from planner.engines import ENGINES
from planner.engines.spec import PARTS, EngineSpec

ROOT = Path(__file__).resolve().parents[2]
LOGS = ROOT / "tests" / "fixtures" / "logs"
runner = CliRunner()

#: the tiny model each engine plans (Megatron and torchtitan build a GPT from architecture(); every engine can run it)
TINY = ["plan", str(ROOT / "examples" / "llama.py"), "--model-arg", "preset=llama-tiny"]
#: a 2-stage pipeline on 2 GPUs of a kind every engine runs (A100: no FP8, no CPU-only engines)
GPUS = ["--gpus", "2xA100", "--pp", "2"]


@pytest.fixture(scope="module", params=sorted(ENGINES))
def planned(request, tmp_path_factory) -> tuple[EngineSpec, Path]:
    spec = ENGINES[request.param]
    out = tmp_path_factory.mktemp(spec.name) / "plan"
    r = runner.invoke(app, [*TINY, *GPUS, "--engine", spec.name, "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    return spec, out


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_part_is_there_or_declared_missing(name):
    spec = ENGINES[name]
    assert spec.problems() == []
    assert spec.name == name and spec.package == f"planner.engines.{name}"
    for part in PARTS:
        if not spec.has(part):
            assert len(spec.lacks[part]) > 20  # a reason, not a placeholder


def test_a_half_built_wing_fails_the_kit(tmp_path, monkeypatch):
    """A wing of one rules module and a renderer without ``render``: every other part is neither there nor declared
    missing, and the renderer breaks its contract."""
    pkg = tmp_path / "halfwing"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "render.py").write_text("def draw(plan, command):\n    return {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = EngineSpec(ENGINES["torch"].rules, "halfwing", lacks={"runner": "none needed"})
    problems = spec.problems()
    assert any("halfwing.render lacks render" in p for p in problems)
    for part in ("validate", "smoke", "logs"):
        assert any(f"no halfwing.{part}" in p for p in problems), part
    assert not any("runner" in p and "no halfwing" in p for p in problems)
    # and a part declared missing that exists is a stale declaration
    stale = EngineSpec(ENGINES["torch"].rules, "halfwing", lacks={"render": "said to be missing"})
    assert any("declared missing" in p for p in stale.problems())


def test_its_plan_directory_validates_with_no_error(planned):
    spec, out = planned
    r = runner.invoke(app, ["validate", str(out), "--model", str(ROOT / "examples" / "llama.py"), "--model-arg", "preset=llama-tiny", "--format", "json"])
    findings = json.loads(r.stdout)
    assert [f for f in findings if f["severity"] == "error"] == [], findings
    assert r.exit_code == 0
    if spec.entry_file:
        assert (out / spec.entry_file).is_file()


def test_it_re_prices_to_the_same_step_time(planned):
    from planner import hardware
    from planner.model.analyze import analyze
    from planner.planning import evaluate_pinned
    from planner.solve.plan import load_plan
    from planner.solve.settings import Settings

    spec, out = planned
    plan = load_plan(out)
    req = Settings.pinned_to(
        {**plan.inputs, "model_file": str(ROOT / "examples" / "llama.py")}, plan.layout, tuple(s.pieces[0] for s in plan.stages) + (plan.stages[-1].pieces[1],)
    )
    req = req.but(mem_target=plan.settings.memory.mem_target)
    costs = analyze(
        req.model.model_file, req.model.model_args, req.model.cost_micro_batch, req.model.dtype, list(req.model.leaf), req.model.tracer, sub_block_cuts=True
    ).costs
    result = evaluate_pinned(costs, hardware.parse_gpus(req.cluster.gpus), req)
    assert result.best is not None
    assert result.best.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=5e-6)  # plan.json keeps 6 significant digits


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_it_reads_its_own_log_format(name):
    from planner.check.run_logs import read_log

    spec = ENGINES[name]
    if not spec.has("logs"):
        pytest.skip(f"{name} declares no log reader: {spec.lacks['logs']}")
    logs = sorted(LOGS.glob(f"{name}_*.log"))
    readable = [p for p in logs if "damaged" not in p.name and "oom" not in p.name and "nan" not in p.name]
    assert readable, f"no fixture log of {name} in {LOGS}"
    for path in readable:
        m = read_log(path)
        assert m.kind == name and m.step_times_s and min(m.step_times_s) > 0


def test_it_smokes_on_cpu_or_its_own_checks_pass(planned):
    spec, out = planned
    if not spec.has("smoke"):
        r = runner.invoke(app, ["smoke", str(out)])
        assert r.exit_code == 2 and spec.lacks["smoke"] in r.output  # refused by the spec, with its reason
        return
    r = runner.invoke(app, ["smoke", str(out), "--steps", "2", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "smoke.json").read_text())
    assert doc["ok"] and doc["engine"] == spec.name
    if doc["trained"]:
        assert doc["max_relative_difference"] <= 1e-5
