"""`planner validate` (planner/check): the corpus of good and bad configs, DeepSpeed's own verdicts and key lists,
rendered plans validating clean, cross-file checks, drift, and the output formats."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from planner.check.validate import (
    Options,
    all_rules,
    classify,
    read_command,
    validate,
    validate_paths,
)
from planner.cli import app
from planner.engines.deepspeed import config_class as deepspeed_engine
from planner.engines.deepspeed.config_class import (
    BatchError,
    vendored_batch,
    vendored_partition_balanced,
    vendored_partition_uniform,
)
from planner.engines.deepspeed.config_rules import (
    DEEPSPEED_VERSION,
    DSContext,
    check_ds_config,
    known_keys,
    table_path,
)
from planner.engines.deepspeed.config_rules import RULES as DS_RULES
from planner.errors import PlannerError, UsageError
from planner.findings import exit_code, format_findings
from planner.model_ref import resolve_ref

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "validate"
runner = CliRunner()
CASES: dict = json.loads((FIX / "cases.json").read_text())["cases"]


def _options(o: dict, run_scripts: bool = False) -> Options:
    model = str(ROOT / o["model"]) if o.get("model") else None
    return Options(gpus=o.get("gpus"), model=model, model_args=o.get("model_args"), pp=o.get("pp"), run_scripts=run_scripts)


def _rules(findings, with_info: bool = False) -> set[str]:
    return {f.rule for f in findings if with_info or f.severity != "info"}


# --------------------------------------------------------------------------- the corpus


@pytest.fixture(params=["deepspeed", "no-deepspeed"])
def ds_mode(request, monkeypatch):
    """Run a test with DeepSpeed's own code answering, and again with the fallbacks (as if deepspeed were absent)."""
    if request.param == "deepspeed":
        pytest.importorskip("deepspeed")
        assert deepspeed_engine.available()
    else:
        monkeypatch.setattr(deepspeed_engine, "_modules", lambda: None)
        assert not deepspeed_engine.available()
    return request.param


@pytest.mark.parametrize("name", sorted(CASES))
def test_corpus_case_reports_exactly_its_rules(name, ds_mode):
    case = CASES[name]
    report = validate([FIX / name], _options(case["options"], run_scripts=True))  # the scripts of the corpus are run (--run-scripts)
    assert _rules(report.findings) == set(case["rules"]), "\n".join(map(str, report.findings))
    for f in report.findings:
        assert f.rule in all_rules() and f.severity == all_rules()[f.rule][0]
        assert f.line is None or f.line >= 1
        assert f.message and f.fix


def test_corpus_covers_every_rule_with_a_bad_config():
    bad = {n: c for n, c in CASES.items() if n.startswith("bad/")}
    assert len(bad) >= 25
    assert sorted(p.relative_to(FIX).as_posix() for p in FIX.glob("*/*") if p.is_file()) == sorted(CASES)  # nothing unlisted
    single = {c["rules"][0] for c in bad.values() if len(c["rules"]) == 1}
    want = {r for r, (sev, _) in DS_RULES.items() if sev != "info"} | {"MEM001"}
    assert want <= single, want - single
    assert len({r for r in single if r.startswith("MEG")}) >= 15


def test_seed_recommendation_zero3_with_pipeline_is_refused_with_every_problem():
    """The config of /work/shared/seeds/001_4ac20428d8bce549.txt section 4 (ZeRO-3 + offload + a pipeline section)."""
    path = FIX / "bad" / "seed_zero3_pipeline.json"
    text = path.read_text()
    for opts in (Options(gpus="8xA100", pp=4), Options()):
        found = {(f.rule, f.line): f for f in validate([path], opts).findings}
        line = lambda key: 1 + text[: text.index(f'"{key}"')].count("\n")
        zero3 = found[("DS002", line("stage"))]
        assert "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" in zero3.message and "PipelineEngine.__init__" in zero3.message
        ckpt = found[("DS005", line("activation_checkpointing"))]
        assert "activation_checkpoint_interval" in ckpt.message and "silently ignores" in ckpt.message
        part = found[("DS007", line("partition_method"))]
        assert "PipelineModule" in part.message
    # without --gpus the batch arithmetic is explained, not guessed
    assert "DS013" in _rules(validate([path], Options()).findings, with_info=True)


def test_lone_config_batch_without_pp_considers_every_pipeline_depth():
    cfg = {"train_batch_size": 96, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}
    text = json.dumps(cfg, indent=2)
    ok = check_ds_config(text, DSContext("c.json", world_size=8)).findings  # dp 3 is impossible on 8 GPUs
    assert [f.rule for f in ok] == ["DS001"] and "no pipeline depth" in ok[0].message
    cfg["train_batch_size"] = 64  # dp 2: pp 4
    notes = check_ds_config(json.dumps(cfg), DSContext("c.json", world_size=8)).findings
    assert [(f.rule, f.severity) for f in notes] == [("DS013", "info")] and "data-parallel size of 2" in notes[0].message


# --------------------------------------------------------------------------- DeepSpeed's own sources and verdicts


def test_shipped_key_table_matches_installed_deepspeed():
    """The shipped table equals a fresh extraction by tools/deepspeed_key_table.py from the installed DeepSpeed."""
    deepspeed = pytest.importorskip("deepspeed")
    from tools.deepspeed_key_table import extract_key_table, format_table, main

    assert deepspeed.__version__ == DEEPSPEED_VERSION, (
        f"DeepSpeed {deepspeed.__version__} is installed, the table is for {DEEPSPEED_VERSION}: update DEEPSPEED_VERSION and run "
        "`python tools/deepspeed_key_table.py --write`"
    )
    assert format_table(extract_key_table()) == table_path().read_text(), "stale table: run `python tools/deepspeed_key_table.py --write`"
    assert main(["--check"]) == 0


def test_validate_does_not_import_the_table_extractor():
    """validate reads the shipped table only: no planner module imports tools/ or walks JSON with json.decoder."""
    import ast

    for path in (ROOT / "planner").rglob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {m for m in imported if m.startswith(("tools", "json.decoder"))}, path
        uses = {ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not {u for u in uses if u.startswith("json.decoder")}, path


def test_key_policies_match_what_deepspeed_config_does(monkeypatch):
    """Keys the table calls strict are refused by DeepSpeedConfig; keys it calls loose pass silently; fields all known."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    table = known_keys()
    assert set(DeepSpeedZeroConfig.model_fields) <= set(table.sections["zero_optimization"])
    base = {"train_batch_size": 8}
    for section in ("zero_optimization", "fp16", "bf16", "zero_optimization.offload_optimizer"):
        assert table.policy[section] == "forbid"
        cfg = json.loads(json.dumps(base))
        node = cfg
        for part in section.split("."):
            node = node.setdefault(part, {})
        node["not_a_key"] = 1
        with pytest.raises(Exception, match="not_a_key|[Ee]xtra"):
            DeepSpeedConfig(cfg)
    for section in ("", "pipeline", "activation_checkpointing"):
        assert table.policy[section] == "ignore"
        cfg = json.loads(json.dumps(base))
        (cfg.setdefault(section, {}) if section else cfg)["not_a_key"] = 1
        DeepSpeedConfig(cfg)  # accepted: that is why validate reports it
    assert {k for k, i in table.sections["pipeline"].items() if i.kind == "unread"} == {"stages", "partition", "seed_layers"}


def test_batch_verdicts_agree_with_deepspeed_config(monkeypatch, ds_mode):
    """DS001 iff DeepSpeedConfig raises, for N data-parallel ranks (dist patched as engines.md says), with DeepSpeed
    answering and with the vendored arithmetic; the filled values equal DeepSpeedConfig's."""
    pytest.importorskip("deepspeed")
    import deepspeed.runtime.config as ds_config

    values = {"tbs": (None, 0, 8, 12, 16, 24, 48), "micro": (None, 0, 1, 2, 3, 4), "gas": (None, 0, 1, 2, 4)}
    checked = disagreements = refused = 0
    for world in (1, 2, 3, 4, 8):
        for tbs in values["tbs"]:
            for micro in values["micro"]:
                for gas in values["gas"]:
                    cfg = {
                        k: v
                        for k, v in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", gas))
                        if v is not None
                    }
                    with monkeypatch.context() as m:  # DeepSpeedConfig itself, independently of planner.check
                        m.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
                        m.setattr(ds_config.dist, "get_world_size", lambda *a, _w=world, **k: _w)
                        try:
                            ds = ds_config.DeepSpeedConfig(dict(cfg))
                            theirs = (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps)
                        except (AssertionError, ZeroDivisionError, TypeError, ValueError):
                            theirs = None
                    ours_findings = check_ds_config(json.dumps(cfg), DSContext("c.json", world_size=world, pp=1, pp_source="test")).findings
                    ours_error = any(f.rule == "DS001" for f in ours_findings)
                    try:
                        ours = deepspeed_engine.batch_values(
                            cfg.get("train_batch_size"), cfg.get("train_micro_batch_size_per_gpu"), cfg.get("gradient_accumulation_steps"), world
                        )
                    except BatchError:
                        ours = None
                    try:
                        vendored = vendored_batch(
                            cfg.get("train_batch_size"), cfg.get("train_micro_batch_size_per_gpu"), cfg.get("gradient_accumulation_steps"), world
                        )
                    except BatchError:
                        vendored = None
                    checked += 1
                    refused += theirs is None
                    if ours_error != (theirs is None) or ours != theirs or vendored != theirs:
                        disagreements += 1
                        print("disagree", world, cfg, ours, vendored, theirs, ours_findings)
    assert checked == 5 * 7 * 6 * 5 and disagreements == 0
    assert 200 < refused < checked - 200  # both verdicts are exercised


def test_partition_methods_match_deepspeed(ds_mode):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime import utils as ds_utils

    rng = random.Random(0)
    for _ in range(40):
        n, parts = rng.randint(1, 24), rng.randint(1, 8)
        weights = [rng.choice([0, 1, 5, 100, 12352, 33856]) for _ in range(n)]
        theirs_b, theirs_u = list(ds_utils.partition_balanced(weights, parts)), list(ds_utils.partition_uniform(n, parts))
        assert deepspeed_engine.partition_balanced(weights, parts) == theirs_b == vendored_partition_balanced(weights, parts)
        assert deepspeed_engine.partition_uniform(n, parts) == theirs_u == vendored_partition_uniform(n, parts)


# --------------------------------------------------------------------------- plan directories


@cache
def _plan(model: str, engine: str, gpus: str, **pins):
    from planner.planning import plan_model
    from planner.solve.settings import Settings

    return plan_model(Settings.of(model_file=model, model_args={"preset": "gpt2-tiny"}, gpus=gpus, engine=engine, **pins))[0]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "gpt2.py"
    shutil.copy(ROOT / "examples" / "gpt2.py", path)
    return str(path)


def _plan_dir(root: Path, model: str, engine: str, name: str | None = None, command: str | None = None, **pins) -> Path:
    from planner.render import write_plan_dir

    out = root / (name or engine)
    plan = _plan(model, engine, "4xA100", pp=2, **pins)
    write_plan_dir(out, plan, command or f"planner plan {model} --model-arg preset=gpt2-tiny --gpus 4xA100 --engine {engine} --pp 2 --out {out}")
    return out


@pytest.mark.parametrize("engine", ["deepspeed", "megatron", "torch"])
def test_untouched_render_passes_with_drift_check(tmp_path, model_file, engine):
    d = _plan_dir(tmp_path, model_file, engine)
    report = validate([d], Options(model=model_file))
    assert _rules(report.findings, with_info=True) == set(), "\n".join(map(str, report.findings))
    plan = _plan(model_file, engine, "4xA100", pp=2)
    assert [round(t) for t in report.memory[0].rank_total_bytes] == [r.memory_bytes["total"] for r in plan.ranks]


def test_dense_megatron_plans_with_tensor_parallelism_are_memory_checked(tmp_path, model_file):
    """A script without --expert-tensor-parallel-size leaves it at tp (Megatron's default); a dense model builds no
    experts, so the memory check prices the script's layout with no expert groups (it skipped every dense plan with
    tp > 1 as 'the model has no routed experts')."""
    d = _plan_dir(tmp_path, model_file, "megatron", tp=2)
    report = validate([d], Options(model=model_file))
    assert _rules(report.findings, with_info=True) == set(), "\n".join(map(str, report.findings))
    plan = _plan(model_file, "megatron", "4xA100", pp=2, tp=2)
    assert plan.layout.tp == 2
    assert [round(t) for t in report.memory[0].rank_total_bytes] == [r.memory_bytes["total"] for r in plan.ranks]


def test_hand_edited_ds_config_fails_with_a_diff(tmp_path, model_file):
    d = _plan_dir(tmp_path, model_file, "deepspeed")
    cfg = d / "ds_config.json"
    cfg.write_text(cfg.read_text().replace('"activation_checkpoint_interval": 0', '"activation_checkpoint_interval": 1'))
    assert _rules(validate([d], Options()).findings) == {"PLAN001"}
    code, text = validate_paths([d], model=model_file)
    assert code == 1
    assert "DRIFT001" in text and '-    "activation_checkpoint_interval": 1,' in text and '+    "activation_checkpoint_interval": 0,' in text
    drift = [f for f in validate([d], Options(model=model_file)).findings if f.rule == "DRIFT001"]
    assert len(drift) == 1 and drift[0].file.endswith("ds_config.json")
    assert cfg.read_text().splitlines()[drift[0].line - 1].strip().startswith('"activation_checkpoint_interval": 1')


def test_hand_edited_megatron_flag_fails_with_a_diff(tmp_path, model_file):
    d = _plan_dir(tmp_path, model_file, "megatron")
    script = d / "pretrain_gpt.sh"
    text = script.read_text()
    assert "--micro-batch-size 8\n" in text
    script.write_text(text.replace("--micro-batch-size 8\n", "--micro-batch-size 4\n"))
    findings = validate([d], Options(model=model_file)).findings
    assert _rules(findings) == {"PLAN002", "DRIFT001"}, "\n".join(map(str, findings))
    drift = next(f for f in findings if f.rule == "DRIFT001")
    assert "-  --micro-batch-size 4" in drift.detail and "+  --micro-batch-size 8" in drift.detail
    plan002 = next(f for f in findings if f.rule == "PLAN002")
    assert script.read_text().splitlines()[plan002.line - 1].strip() == "--micro-batch-size 4"


def test_changed_model_file_fails_and_asks_to_replan(tmp_path):
    model = tmp_path / "model.py"
    shutil.copy(ROOT / "examples" / "gpt2.py", model)
    d = _plan_dir(tmp_path, str(model), "torch")
    assert validate([d], Options(model=str(model))).findings == []
    model.write_text(model.read_text() + "\n# a harmless edit\n")
    findings = validate([d], Options(model=str(model))).findings
    assert "DRIFT002" in _rules(findings)
    assert "re-plan" in next(f for f in findings if f.rule == "DRIFT002").fix


def test_drift_reads_the_escaped_command_back_from_the_headers(tmp_path, monkeypatch):
    """A hostile model path and a command with quotes, $(...), a newline and backslashes survive the round trip."""
    monkeypatch.chdir(tmp_path)
    model = Path('my model\'s "dir"/$(touch x)/model.py')
    model.parent.mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "gpt2.py", model)
    command = f"planner plan {model} --out 'dir'\nrm -rf / \\ end"
    d = _plan_dir(Path("plans"), str(model), "deepspeed", command=command)
    assert read_command(d)[1] == command
    assert validate([d], Options(model=str(model))).findings == []
    assert not (tmp_path / "x").exists()


def test_plan_json_rules(tmp_path, model_file):
    d = _plan_dir(tmp_path, model_file, "torch")
    assert validate([d], Options(gpus="8xA100")).findings and _rules(validate([d], Options(gpus="8xA100")).findings) == {"PLAN004"}
    plan = json.loads((d / "plan.json").read_text())
    plan["layout"]["zero"] = 2
    (d / "plan.json").write_text(json.dumps(plan, indent=2))
    assert _rules(validate([d], Options()).findings) == {"PLAN003"}
    plan["schema_version"] = 99
    (d / "plan.json").write_text(json.dumps(plan, indent=2))
    assert _rules(validate([d], Options()).findings) == {"PLAN005"}


def test_memory_failure_names_the_stage_and_overflow(tmp_path, model_file):
    d = _plan_dir(tmp_path, model_file, "deepspeed")
    cfg = json.loads((d / "ds_config.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 1 << 20
    cfg["train_batch_size"] = (1 << 20) * cfg["gradient_accumulation_steps"] * 2
    (d / "ds_config.json").write_text(json.dumps(cfg, indent=2))
    assert not [f for f in validate([d], Options()).findings if f.rule == "MEM001"]  # the model is imported only with --model
    mem = [f for f in validate([d], Options(model=model_file)).findings if f.rule == "MEM001"]
    assert mem and all(re.search(r"pipeline rank \d \(stage \d: pieces \[\d+, \d+\).*GiB more than the [\d.]+ GiB", f.message) for f in mem)
    assert "the stage split of plan.json" in mem[0].message


def test_directory_of_plan_directories(tmp_path, model_file):
    root = tmp_path / "plans"
    _plan_dir(root, model_file, "deepspeed")
    _plan_dir(root, model_file, "megatron")
    shutil.copy(FIX / "bad" / "ds005_pipline.json", root / "extra_ds_config.json")
    report = validate([root], Options(model=model_file))
    assert _rules(report.findings) == {"DS005"}
    assert {Path(p).name for p in report.checked} >= {"plan.json", "ds_config.json", "pretrain_gpt.sh", "extra_ds_config.json"}


# --------------------------------------------------------------------------- every rendered plan validates clean


@pytest.mark.parametrize("engine", ["deepspeed", "megatron", "torch"])
@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    preset=st.sampled_from([("gpt2", "gpt2-tiny"), ("llama", "llama-tiny")]),
    gpus=st.sampled_from(["2xcpu", "4xcpu", "8xcpu", "2xA100", "4xA100", "8xA100"]),
    pp=st.sampled_from([None, 1, 2, 4]),
    micro_batch=st.sampled_from([None, 1, 2, 4]),
    recompute=st.sampled_from([None, "none", "full"]),
    schedule=st.sampled_from([None, "gpipe", "1f1b", "interleaved", "zb-h1", "zbv"]),
)
def test_rendered_plans_validate_clean(tmp_path_factory, engine, preset, gpus, pp, micro_batch, recompute, schedule):
    from planner.planning import plan_model
    from planner.render import write_plan_dir
    from planner.solve.settings import Settings

    model = str(ROOT / "examples" / f"{preset[0]}.py")
    if engine != "torch":
        schedule = None
    req = Settings.of(
        model_file=model, model_args={"preset": preset[1]}, gpus=gpus, engine=engine, pp=pp, micro_batch=micro_batch, recompute=recompute, schedule=schedule
    )
    try:
        plan = plan_model(req)[0]
    except PlannerError:
        assume(False)  # pins no layout satisfies
    out = tmp_path_factory.mktemp("rendered") / "plan"
    write_plan_dir(out, plan, f"planner plan {model} --gpus {gpus} --engine {engine} --out {out}")
    report = validate([out], Options(model=model))
    assert [f for f in report.findings if f.severity != "info"] == [], "\n".join(map(str, report.findings))
    assert report.memory, "memory was not checked"
    assert [round(t) for t in report.memory[0].rank_total_bytes] == [r.memory_bytes["total"] for r in plan.ranks]


@pytest.mark.parametrize(
    "preset, pins",
    [("moe-tiny", dict(pp=2, tp=2)), ("moe-tiny", dict(pp=2, tp=1, ep=2, etp=1)), ("moe-tiny", dict(pp=2, tp=2, ep=2, etp=2)), ("deepseek-tiny", dict(pp=2))],
)
def test_rendered_moe_plans_validate_clean(tmp_path, preset, pins):
    """Megatron plans of examples/moe.py (MoE flags, MLA for deepseek-tiny) pass every rule, the drift check and the memory
    check, which prices the script's own expert groups (--expert-model-parallel-size, --expert-tensor-parallel-size) to
    the byte of plan.json's ranks."""
    from planner.planning import plan_model
    from planner.render import write_plan_dir
    from planner.solve.settings import Settings

    model = str(ROOT / "examples" / "moe.py")
    plan = plan_model(Settings.of(model_file=model, model_args={"preset": preset}, gpus="8xA100", engine="megatron", **pins))[0]
    out = tmp_path / "plan"
    write_plan_dir(out, plan, f"planner plan {model} --gpus 8xA100 --engine megatron --out {out}")
    assert "--num-experts" in (out / "pretrain_gpt.sh").read_text()
    assert (plan.layout.ep, plan.layout.etp) == (pins.get("ep", plan.layout.ep), pins.get("etp", plan.layout.etp))
    report = validate([out], Options(model=model))
    assert [f for f in report.findings if f.severity != "info"] == [], "\n".join(map(str, report.findings))
    assert report.memory, "memory was not checked"
    assert [round(t) for t in report.memory[0].rank_total_bytes] == [r.memory_bytes["total"] for r in plan.ranks]


# --------------------------------------------------------------------------- formats, exit codes, usage errors


GITHUB = re.compile(r"^::(error|warning|notice) file=([^,:]+)(?:,line=(\d+))?,title=([A-Z]+\d{3})::(.+)$")


def test_github_annotations_parse_and_json_is_valid():
    paths = [FIX / "bad" / "seed_zero3_pipeline.json", FIX / "bad" / "meg029_flag_twice.args", FIX / "bad" / "ds006_stray_key.json"]
    code, text = validate_paths(paths, gpus="8xA100", fmt="github")
    assert code == 1
    lines = [l for l in text.splitlines() if l.startswith("::")]
    assert len(lines) >= 5
    for line in lines:
        m = GITHUB.match(line)
        assert m, line
        assert Path(m.group(2).replace("%3A", ":").replace("%2C", ",")).is_file()
        assert "\n" not in m.group(5)
    assert {GITHUB.match(l).group(1) for l in lines} >= {"error", "warning"}
    code, text = validate_paths(paths, gpus="8xA100", fmt="json")
    data = json.loads(text)
    assert {d["rule"] for d in data} >= {"DS002", "MEG029", "DS006"}
    assert all(set(d) == {"rule", "severity", "file", "line", "message", "fix", "detail"} for d in data)


def test_exit_codes_and_strict():
    warn = FIX / "bad" / "ds006_stray_key.json"
    assert validate_paths([warn], gpus="4xA100", pp=2)[0] == 0
    assert validate_paths([warn], gpus="4xA100", pp=2, strict=True)[0] == 1
    assert validate_paths([FIX / "good" / "ds_pipeline.json"], gpus="8xA100", pp=2, strict=True)[0] == 0
    assert exit_code([]) == 0


def test_usage_errors(tmp_path):
    with pytest.raises(UsageError):
        validate_paths([tmp_path / "missing"])
    other = tmp_path / "notes.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(UsageError, match="not a DeepSpeed config"):
        validate_paths([other])
    with pytest.raises(UsageError):
        validate_paths([FIX / "good" / "ds_pipeline.json"], fmt="xml")
    with pytest.raises(PlannerError):
        validate_paths([FIX / "good" / "ds_pipeline.json"], gpus="3xNoSuchGPU")
    with pytest.raises(UsageError, match="--pp"):
        validate_paths([FIX / "good" / "ds_pipeline.json"], gpus="8xA100", pp=3)
    # a directory with nothing the validator reads (a typo'd CI path, the wrong checkout) fails instead of passing
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "sub" / "notes.txt").write_text("launch notes, no config\n")
    with pytest.raises(UsageError, match="holds nothing to check"):
        validate_paths([tmp_path / "empty"])
    with pytest.raises(UsageError, match="holds nothing to check"):
        validate_paths([FIX / "good" / "ds_pipeline.json", tmp_path / "empty"], gpus="8xA100", pp=2)


def test_recognition_by_content_not_name(tmp_path):
    ds = tmp_path / "whatever.conf"
    ds.write_text((FIX / "bad" / "ds005_pipline.json").read_text())
    meg = tmp_path / "train_args"
    meg.write_text((FIX / "good" / "megatron.args").read_text())
    assert classify(ds, ds.read_text()) == "deepspeed"
    assert classify(meg, meg.read_text()) == "megatron-args"
    assert classify(FIX / "good" / "megatron_launch.sh", (FIX / "good" / "megatron_launch.sh").read_text()) == "megatron-script"
    slurm = tmp_path / "launch_slurm.sh"
    slurm.write_text("#!/bin/bash\n#SBATCH --nodes=1\nsrun bash -c './pretrain_gpt.sh'\n")
    assert classify(slurm, slurm.read_text()) is None
    assert format_findings([], "text").strip().startswith("0 error(s)")


def test_megatron_if_else_is_checked_on_the_arm_bash_runs():
    """Both arms set the split; only the arm bash runs is checked, and the finding points at that arm's line."""
    path = FIX / "bad" / "meg003_if_else_arm.sh"
    (f,) = [f for f in validate([path], Options(run_scripts=True)).findings if f.severity != "info"]
    assert f.rule == "MEG003" and "9 layers" in f.message
    assert f.line == 1 + path.read_text().splitlines().index("  SPLIT=(--num-layers 9 --pipeline-model-parallel-size 2)")
    assert not [f for f in validate([FIX / "good" / "megatron_if_else.sh"], Options(run_scripts=True)).findings if f.severity != "info"]


def test_megatron_script_that_never_launches_is_stopped_with_a_finding():
    import time

    start = time.monotonic()
    (f,) = [f for f in validate([FIX / "bad" / "meg031_loops_forever.sh"], Options(run_scripts=True)).findings if f.severity != "info"]
    assert f.rule == "MEG031" and ("limit" in f.message or "past" in f.message)
    assert time.monotonic() - start < 30


# --------------------------------------------------------------------------- as strict as DeepSpeed (DS016)

#: configs DeepSpeed 0.19.8's DeepSpeedConfig refuses by type or range, and the key each finding must point at
REFUSED = {
    "zero_optimization_string": ({"zero_optimization": "x"}, "zero_optimization"),
    "bf16_number": ({"bf16": 1}, "bf16"),
    "pipeline_string": ({"pipeline": "x"}, "pipeline"),
    "loss_scale_string": ({"fp16": {"enabled": True, "loss_scale": "big"}}, "loss_scale"),
    "negative_bucket": ({"zero_optimization": {"stage": 1, "reduce_bucket_size": -5}}, "reduce_bucket_size"),
    "fractional_stage": ({"zero_optimization": {"stage": 1.5}}, "stage"),
}
BATCH = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_deepspeed_config_refuses_is_an_error_on_the_right_line(tmp_path, name, ds_mode):
    extra, key = REFUSED[name]
    path = tmp_path / "ds_config.json"
    text = json.dumps({**BATCH, **extra}, indent=2)
    path.write_text(text)
    code, _ = validate_paths([path], gpus="4xA100", pp=2)
    assert code == 1
    found = [f for f in validate([path], Options(gpus="4xA100", pp=2)).findings if f.severity == "error"]
    assert [f.rule for f in found] == ["DS016"], found
    assert found[0].line == 1 + text[: text.index(f'"{key}"')].count("\n")
    if ds_mode == "deepspeed":  # DeepSpeed's own words, for the planned data-parallel size (4 GPUs / pp 2)
        import deepspeed.runtime.config as ds_config

        with pytest.raises(Exception) as theirs:
            ds_config.DeepSpeedConfig({**BATCH, **extra})
        assert deepspeed_engine.describe(theirs.value).split(": ", 1)[1].split(" (got")[0] in found[0].message
        assert "2 data-parallel ranks" in found[0].message
    else:
        assert "deepspeed is not installed" in found[0].message


def test_every_refusal_is_reported_once_and_explained_ones_are_not_repeated(tmp_path):
    pytest.importorskip("deepspeed")
    cfg = {**BATCH, "zero_optimization": {"stage": 1.5, "reduce_bucket_size": -5, "stagee": 2}, "pipeline": "x", "amp": {"enabled": True}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg, indent=2))
    found = sorted(
        (f.rule, f.message.split(" at ")[1].split(":")[0] if f.rule == "DS016" else "")
        for f in validate([path], Options(gpus="4xA100", pp=2)).findings
        if f.severity == "error"
    )
    assert found == [
        ("DS004", ""),
        ("DS010", ""),
        ("DS016", "pipeline"),
        ("DS016", "zero_optimization.reduce_bucket_size"),
        ("DS016", "zero_optimization.stage"),
    ]


def test_type_checks_without_deepspeed_never_refuse_what_deepspeed_accepts():
    """The fallback's verdicts against DeepSpeedConfig on a grid of hostile values: no false refusal, and the
    refusals the issue lists are caught by both."""
    pytest.importorskip("deepspeed")
    table = known_keys()
    sections = tuple(sorted(k for k, i in table.sections[""].items() if i.kind == "section"))
    values = ("x", "5", "1", "1.5", 1, 1.5, -5, 0, True, False, [], None, {}, float("nan"), float("inf"))
    cfgs = [{**BATCH, k: v} for k in sections for v in values]
    for name in ("stage", "reduce_bucket_size", "allgather_bucket_size", "stage3_max_live_parameters", "sub_group_size"):
        cfgs += [{**BATCH, "zero_optimization": {name: v}} for v in values]
    cfgs += [{**BATCH, "fp16": {"enabled": True, "loss_scale": v}} for v in values]
    caught = 0
    for cfg in cfgs:
        ours = deepspeed_engine.type_problems(cfg, sections)
        theirs = deepspeed_engine.refusal(cfg, 2)
        assert not (ours and theirs is None), (cfg, ours)
        caught += bool(ours)
    assert caught > 300
    for extra, _ in REFUSED.values():
        assert deepspeed_engine.type_problems({**BATCH, **extra}, sections) and deepspeed_engine.refusal({**BATCH, **extra}, 2)


def test_deep_or_broken_configs_are_findings_not_crashes(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text('{"train_batch_size": 8, "x": ' + "[" * 100000 + "]" * 100000 + "}")
    assert [f.rule for f in validate([deep], Options()).findings if f.severity == "error"] == ["DS014"]
    dup = tmp_path / "dup.json"
    dup.write_text('{\n "train_batch_size": 8,\n "fp16": {"enabled": false},\n "train_batch_size": 16\n}')
    (f,) = [f for f in validate([dup], Options()).findings if f.severity == "error"]
    assert f.rule == "DS014" and f.line == 4 and "first on line 2" in f.message


def test_key_lines_follow_the_structure_not_the_first_match():
    from planner.json_doc import key_lines, parse_json

    text = r"{" + "\n" + r' "a": {"x": {"b": 1}, "l": [1, {"q": "s\"b:"}, [2, {"r": 3}]]},' + "\n" + r' "b": 2,' + "\n" + r' "k\u0041": {"z": "}"}' + "\n}"
    doc = parse_json(text)
    assert doc.value["a"]["l"][1]["q"] == 's"b:'
    assert doc.value["kA"] == {"z": "}"}
    assert doc.lines == {
        ("a",): 2,
        ("a", "x"): 2,
        ("a", "x", "b"): 2,
        ("a", "l"): 2,
        ("a", "l", 1, "q"): 2,
        ("a", "l", 2, 1, "r"): 2,
        ("b",): 3,
        ("kA",): 4,
        ("kA", "z"): 4,
    }
    assert key_lines('{"a": {"b": 1},\n"a": {"b": 2}}')[1] == [(("a",), 2, 1)]  # the parent, not its children again


def test_json_output_stays_valid_when_deepspeed_logs(tmp_path):
    """DeepSpeed logs to stdout; validate --format json must still print only JSON."""
    import subprocess
    import sys

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**BATCH, "zero_optimization": True}))  # a deprecated form DeepSpeed warns about
    out = subprocess.run(
        [sys.executable, "-m", "planner", "validate", str(path), "--gpus", "4xA100", "--pp", "2", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    assert out.returncode in (0, 1), out.stderr
    json.loads(out.stdout)


# --------------------------------------------------------------------------- plan.json fields, engine files, model imports


@pytest.fixture(scope="module")
def ds_plan_dir(tmp_path_factory, model_file) -> Path:
    return _plan_dir(tmp_path_factory.mktemp("dsplan"), model_file, "deepspeed")


TAMPERED = {
    "pp_zero": (lambda d: d["layout"].update(pp=0), "layout.pp"),
    "pp_string": (lambda d: d["layout"].update(pp="2"), "layout.pp"),
    "inputs_null": (lambda d: d.update(inputs=None), "inputs"),
    "step_time_nan": (lambda d: d["predicted"].update(step_time_s=float("nan")), "predicted.step_time_s"),
    "step_time_zero": (lambda d: d["predicted"].update(step_time_s=0), "predicted.step_time_s"),
    "mem_target_nan": (lambda d: d["inputs"].update(mem_target=float("nan")), "inputs.mem_target"),
    "stage_rank_huge": (lambda d: d["stages"][0].update(rank=10**30), "stages.0.rank"),
    "stages_empty": (lambda d: d.update(stages=[]), "stages"),
}


@pytest.mark.parametrize("name", sorted(TAMPERED) + ["non_utf8", "deep"])
def test_tampered_plan_json_is_an_error_never_a_crash(tmp_path, ds_plan_dir, name):
    from typer.testing import CliRunner

    from planner.cli import app

    d = tmp_path / "plan"
    shutil.copytree(ds_plan_dir, d)
    if name == "non_utf8":
        (d / "plan.json").write_bytes(b'{"schema_version": 1, "layout": "\xff\xfe"}')
        want = "not UTF-8"
    elif name == "deep":
        (d / "plan.json").write_text('{"schema_version": 1, "layout": ' + "[" * 100000 + "]" * 100000 + "}")
        want = "nested too deeply"
    else:
        data = json.loads((d / "plan.json").read_text())
        mutate, want = TAMPERED[name]
        mutate(data)
        (d / "plan.json").write_text(json.dumps(data, indent=2))
    errors = [f for f in validate([d], Options()).findings if f.severity == "error"]
    assert [f.rule for f in errors] == ["PLAN005"] and want in errors[0].message, errors
    result = CliRunner().invoke(app, ["validate", str(d)])
    assert result.exit_code == 1 and (result.exception is None or isinstance(result.exception, SystemExit)), (result.output, result.exception)
    assert "Traceback" not in result.output and "PLAN005" in result.output


def test_untouched_plan_json_has_no_field_problems(ds_plan_dir):
    from planner.check.plan_fields import plan_problems

    assert plan_problems(json.loads((ds_plan_dir / "plan.json").read_text())) == []
    assert [f for f in validate([ds_plan_dir], Options()).findings if f.severity != "info"] == []


def test_plan_directory_without_its_ds_config_is_an_error(tmp_path, ds_plan_dir):
    d = tmp_path / "plan"
    shutil.copytree(ds_plan_dir, d)
    (d / "ds_config.json").unlink()
    code, text = validate_paths([d])
    assert code == 1 and "PLAN006" in text and "ds_config.json" in text


def test_validate_never_imports_the_model_file_plan_json_names(tmp_path, ds_plan_dir):
    """Without --model, plan.json's model_file is not imported (it would run someone else's code)."""
    d = tmp_path / "plan"
    shutil.copytree(ds_plan_dir, d)
    marker = tmp_path / "imported"
    evil = tmp_path / "evil.py"
    evil.write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        + Path(resolve_ref(json.loads((d / "plan.json").read_text())["inputs"]["model_file"], ds_plan_dir)).read_text()
    )
    data = json.loads((d / "plan.json").read_text())
    data["inputs"]["model_file"] = str(evil)
    (d / "plan.json").write_text(json.dumps(data, indent=2))
    report = validate([d], Options())
    assert not marker.exists()
    notes = [f for f in report.findings if f.rule == "MEM003"]
    assert notes and "--model" in notes[0].fix and "only when --model names it" in notes[0].message
    assert not report.memory
    validate([d], Options(model=str(evil)))  # named on the command line: imported, and memory is checked
    assert marker.exists()


def test_symlink_loops_in_a_plan_directory_are_walked_once(tmp_path, ds_plan_dir):
    """Two links to the directory itself and one to its parent: each real directory is read once, in bounded time."""
    d = tmp_path / "plan"
    shutil.copytree(ds_plan_dir, d)
    for name, target in (("a", "."), ("b", "."), ("up", "..")):
        (d / name).symlink_to(target)
    plain = validate([ds_plan_dir], Options())
    looped = validate([d], Options())
    assert sorted(f.rule for f in looped.findings) == sorted(f.rule for f in plain.findings)
    assert len(looped.checked) == len(plain.checked)


def test_drift_is_independent_of_the_working_directory(tmp_path, ds_plan_dir, model_file, monkeypatch):
    """A freshly written plan re-plans to the same bytes whether validate runs beside it, above it or elsewhere,
    with the model named by an absolute or a relative path."""
    for cwd in (ds_plan_dir, ds_plan_dir.parent, tmp_path):
        monkeypatch.chdir(cwd)
        for model in (model_file, os.path.relpath(model_file, cwd)):
            found = validate([ds_plan_dir], Options(model=model, model_args={"preset": "gpt2-tiny"}))
            assert not [f for f in found.findings if f.rule.startswith("DRIFT") and f.severity != "info"], (cwd, model, found.findings)


def test_context_parallel_plan_launches_its_whole_world_and_validate_counts_cp(tmp_path, model_file):
    """World = pp x tp x cp x dp: a cp 2 plan on 4 GPUs (pp 2, dp 1) launches 4 processes, validates clean, and a
    launcher that starts pp x tp x dp = 2 processes (the cp group left out) is an error naming cp."""
    d = _plan_dir(tmp_path, model_file, "megatron", cp=2)
    plan = _plan(model_file, "megatron", "4xA100", pp=2, cp=2)
    assert (plan.layout.pp, plan.layout.cp, plan.layout.dp, plan.layout.world) == (2, 2, 1, 4)
    script = d / "pretrain_gpt.sh"
    text = script.read_text()
    assert "GPUS_PER_NODE=4\n" in text and "--context-parallel-size 2" in text
    assert _rules(validate([d], Options(model=model_file)).findings, with_info=True) == set()
    script.write_text(text.replace("GPUS_PER_NODE=4\n", "GPUS_PER_NODE=2\n"))
    findings = [f for f in validate([d], Options()).findings if f.severity == "error"]
    assert any("starts 2 processes" in f.message and "x cp 2 x dp 1 = 4" in f.message for f in findings), "\n".join(map(str, findings))


def test_a_plan_of_an_hf_config_validates_with_its_spec_from_any_directory(tmp_path, monkeypatch):
    """`--model hf:CONFIG.json` re-plans a plan made from that spec (memory and drift checked, no finding), from the
    plan's directory or elsewhere, the config named by a relative or an absolute path: the recorded digest is the
    config's bytes, not its path's spelling. An edited config is DRIFT002."""
    from planner.planning import plan_model
    from planner.render import write_plan_dir
    from planner.solve.settings import Settings

    cfg = tmp_path / "cfg" / "config.json"
    cfg.parent.mkdir()
    shutil.copy(ROOT / "tests" / "models" / "hf" / "llama.json", cfg)
    monkeypatch.chdir(tmp_path)
    spec = "hf:cfg/config.json"
    plan = plan_model(Settings.of(model_file=spec, model_args={"num_hidden_layers": 4}, gpus="4xA100", engine="megatron", pp=2))[0]
    out = tmp_path / "plans" / "llama"
    write_plan_dir(out, plan, f"planner plan {spec} --model-arg num_hidden_layers=4 --gpus 4xA100 --engine megatron --pp 2 --out plans/llama")
    for cwd, ref in ((tmp_path, spec), (out, f"hf:{os.path.relpath(cfg, out)}"), (tmp_path.parent, f"hf:{cfg}")):
        monkeypatch.chdir(cwd)
        found = validate([out], Options(model=ref))
        assert [f for f in found.findings if f.severity != "info"] == [], (cwd, ref, found.findings)
        assert found.memory and found.memory[0].rank_total_bytes  # memory was checked, with the model built from the spec
        # without --model: plan.json's own spec is data, not code, so it is re-planned too (drift and memory checked)
        found = validate([out], Options())
        assert [f for f in found.findings if f.rule in ("DRIFT004", "MEM003") or f.severity != "info"] == [], (cwd, found.findings)
        assert found.memory and found.memory[0].rank_total_bytes
    doc = json.loads(cfg.read_text())
    doc["vocab_size"] = 1024
    cfg.write_text(json.dumps(doc))
    assert "DRIFT002" in _rules(validate([out], Options(model=f"hf:{cfg}")).findings)
    assert "DRIFT002" in _rules(validate([out], Options()).findings)


# --------------------------------------------------------------------------- validate runs nothing it did not render


def test_a_script_read_statically_gives_the_flags_bash_gives():
    """The static reader (planner.script_static) against bash itself, on the corpus' launch script and on a
    script the planner renders: the same launcher argv and environment."""
    from planner.launch_capture import run_script
    from planner.script_static import read_script

    for path in (FIX / "good" / "megatron_launch.sh", FIX / "bad" / "meg022_cuda_max_connections.sh"):
        ran, read = run_script(path), read_script(path)
        assert [c.argv for c in read.calls] == [c.argv for c in ran.calls], path
        own = {
            k: v
            for k, v in ran.calls[0].env.items()
            if k not in ("PATH", "HOME", "TMPDIR", "LC_ALL", "BASH_ENV", "PWD", "SHLVL", "OLDPWD", "_") and not k.startswith("PLANNER_")
        }
        assert read.calls[0].env == own, path
        assert read.how == "read"


HOSTILE = """
touch "$(dirname "$0")/../pwned_by_script"
echo leaked > /tmp/planner_validate_pwned_$$
(sleep 987.654) &
kill -9 $PPID
rm -rf "$(dirname "$0")"
"""


@pytest.fixture
def megatron_plan_dir(tmp_path):
    out = tmp_path / "repo" / "plan"
    r = runner.invoke(
        app,
        [
            "plan",
            str(ROOT / "examples" / "gpt2.py"),
            "--model-arg",
            "preset=gpt2-tiny",
            "--gpus",
            "8xA100",
            "--engine",
            "megatron",
            "--out",
            str(out),
            "--quiet",
        ],
    )
    assert r.exit_code == 0, r.output
    return out


def test_an_edited_launch_script_is_read_and_never_run(megatron_plan_dir, tmp_path):
    """A hand-edited pretrain_gpt.sh that would write outside, delete the plan directory, leave a process behind and
    kill validate: read statically, nothing of it runs, its flags are still checked, and validate says how it read it."""
    script = megatron_plan_dir / "pretrain_gpt.sh"
    text = script.read_text()
    script.write_text(text.replace("set -euo pipefail\n", "set -euo pipefail\n" + HOSTILE))
    found = validate([megatron_plan_dir], Options())
    assert not (tmp_path / "repo" / "pwned_by_script").exists() and not list(Path("/tmp").glob("planner_validate_pwned_*"))
    assert script.is_file() and (megatron_plan_dir / "plan.json").is_file()
    said = [f for f in found.findings if f.rule == "SCRIPT001"]
    assert said and "read without running it" in said[0].message
    assert not [f for f in found.findings if f.severity == "error"]  # the flags are the planned ones
    # an unchanged rendered script is run (its hash is the manifest's), and nothing says otherwise where sandboxed
    script.write_text(text)
    assert not [f for f in validate([megatron_plan_dir], Options()).findings if f.rule == "SCRIPT001" and "read without" in f.message]


def test_run_scripts_runs_an_edited_script_in_the_sandbox(megatron_plan_dir, tmp_path):
    from planner import sandbox

    if sandbox.available() is not None:
        pytest.skip(f"no sandbox here: {sandbox.available()}")
    script = megatron_plan_dir / "pretrain_gpt.sh"
    script.write_text(script.read_text().replace("set -euo pipefail\n", "set -uo pipefail\n" + HOSTILE))
    found = validate([megatron_plan_dir], Options(run_scripts=True))
    assert not (tmp_path / "repo" / "pwned_by_script").exists() and not list(Path("/tmp").glob("planner_validate_pwned_*"))
    assert script.is_file() and (megatron_plan_dir / "plan.json").is_file()
    assert subprocess.run(["pgrep", "-f", "sleep 987.654"], capture_output=True).returncode == 1  # nothing left running
    said = [f for f in found.findings if f.rule == "SCRIPT001"]
    assert said and "in a sandbox" in said[0].message
