"""The torchtitan engine and renderer: schedule names against torch, whole-layer cuts against the piece names,
the FSDP2 state recipe against its closed form, deterministic and shell-safe launch scripts, and (optional,
when torchtitan 0.3.0 and its config dependencies are importable) the rendered overrides parsed by
torchtitan's own ConfigManager."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import EXAMPLES, costs_of
from torch.distributed.pipelining.schedules import get_schedule_class

from planner.engines import get_engine
from planner.engines.torchtitan.render import overrides, render, stage_fqns, torchtitan_stage_ranks
from planner.engines.torchtitan.rules import SCHEDULE_NAMES
from planner.errors import UsageError
from planner.planning import PlanRequest, plan_model
from planner.render import render_files, write_plan_dir
from planner.solve.schedules import SCHEDULE_INFO

ENGINE = get_engine("torchtitan")


def plan_of(example: str = "llama", preset: str = "llama-tiny", gpus: str = "8xH100", **pins):
    req = PlanRequest(model_file=str(EXAMPLES / f"{example}.py"), model_args={"preset": preset}, gpus=gpus, engine="torchtitan", **pins)
    return plan_model(req)[0]


CASES = {
    "1f1b": dict(pp=2, dp=4, schedule="1f1b", zero=0),
    "gpipe_fsdp": dict(pp=2, dp=4, schedule="gpipe", zero=3),
    "interleaved": dict(pp=2, vp=2, dp=4, schedule="interleaved", zero=3, recompute="full"),
    "zbv": dict(pp=2, dp=4, schedule="zbv", zero=0),
}


@pytest.fixture(scope="module")
def plans():
    return {name: plan_of(**pins) for name, pins in CASES.items()}


def test_schedule_names_are_the_torch_classes_we_price():
    """torchtitan looks the name up with torch's get_schedule_class: it must give the class our schedule reproduces."""
    assert set(SCHEDULE_NAMES) == set(ENGINE.schedules)
    for ours, name in SCHEDULE_NAMES.items():
        assert get_schedule_class(name).__name__ == SCHEDULE_INFO[ours].torch_class


def test_cuts_only_between_whole_layers():
    """Brute force over piece names: a cut is allowed exactly where two different torchtitan modules meet, never
    leaving the embedding or norm/output on a stage without a layer."""
    costs = costs_of("llama", "llama-tiny")
    allowed = ENGINE.allowed_cuts(costs)
    modules = [layer.block or layer.name for layer in costs.layers]
    first = modules.index("layers.0")
    last = max(i for i, m in enumerate(modules) if m.startswith("layers."))
    for k in range(1, costs.n):
        expected = modules[k] != modules[k - 1] and first < k <= last
        assert bool(allowed[k]) == expected, (k, modules[k - 1], modules[k])
    assert sum(allowed[1 : costs.n]) == 3  # llama-tiny: between its 4 layers only


def test_state_recipe_closed_form():
    """FSDP2 with bf16 param_dtype: fp32 parameters, fp32 gradients, AdamW 8 bytes, sharded over dp; with a
    pipeline, 2 (unsharded bf16 parameters) + 4 (unsharded fp32 accumulated gradients) not sharded."""
    plan = plan_of(pp=2, dp=4, schedule="1f1b", zero=3)
    for zero, pp, dp, expected in [(3, 2, 4, 16 / 4 + 6), (0, 2, 4, 16 + 6), (3, 1, 8, 16 / 8), (0, 1, 8, 16)]:
        layout = plan.layout.__class__(**{**plan.layout.__dict__, "pp": pp, "dp": dp, "zero": zero})
        recipe = ENGINE.state_recipe("bf16", zero, "adam", layout)
        assert sum(recipe.per_param(dp)) == pytest.approx(expected)
    # the all-gather is priced on weight_bytes: bf16 (param_dtype) under bf16 training
    assert ENGINE.state_recipe("bf16", 3, "adam", plan.layout).weight_bytes == 2.0
    assert ENGINE.state_recipe("fp32", 3, "adam", plan.layout).weight_bytes == 4.0


def test_single_stage_schedules_refuse_virtual_stages():
    assert any("single-stage" in p for p in ENGINE.runtime_schedule_problems("1f1b", 2, 4, 2))
    assert ENGINE.zero_problems(1, 2) and not ENGINE.zero_problems(3, 2)


@pytest.mark.parametrize("name", list(CASES))
def test_plan_renders_the_planned_layout(plans, name):
    plan = plans[name]
    lay = plan.layout
    assert lay.engine == "torchtitan" and lay.schedule == CASES[name]["schedule"]
    parts = stage_fqns(plan)
    assert len(parts) == lay.pp * lay.vp
    flat = [m for part in parts for m in part]
    n = sum(m.startswith("layers.") for m in flat)
    assert flat == ["tok_embeddings", *(f"layers.{i}" for i in range(n)), "norm", "lm_head"]
    assert n == 4
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "lm_head"]
    assert [s.rank for s in plan.stages] == torchtitan_stage_ranks(lay.schedule, lay.pp, len(parts))
    words = overrides(plan)
    assert words[words.index("--parallelism.pipeline_parallel_schedule") + 1] == SCHEDULE_NAMES[lay.schedule]
    assert words[-1] == ("activation-checkpoint:full" if lay.recompute == "full" else "activation-checkpoint:none")
    first = render_files(plan)
    assert first == render_files(plan)  # byte-identical
    assert set(render(plan, "cmd")) == {"launch_torchtitan.sh", "README.md"}


FAKE_TORCHRUN = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["ARGS_OUT"], "w") as f:
    json.dump(sys.argv[1:], f)
"""


def test_launch_script_passes_every_word_intact(plans, tmp_path):
    """A hostile model path and plan directory: the script runs under bash with a stub torchrun that records its
    argv, which must be torchrun's flags, -m torchtitan.train, --module/--config, the user's words, then exactly
    the planned overrides."""
    hostile = tmp_path / "a b$(touch PWNED)'q`x`"
    hostile.mkdir()
    model = hostile / "llama;rm -rf x.py"
    shutil.copy(EXAMPLES / "llama.py", model)
    req = PlanRequest(model_file=str(model), model_args={"preset": "llama-tiny"}, gpus="8xH100", engine="torchtitan", pp=2, dp=4, schedule="1f1b")
    plan = plan_model(req)[0]
    out = hostile / "out $(touch PWNED2)"
    write_plan_dir(out, plan)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "torchrun").write_text(FAKE_TORCHRUN)
    (bindir / "torchrun").chmod(0o755)
    args_out = tmp_path / "args.json"
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "ARGS_OUT": str(args_out), "TORCHTITAN_CONFIG": "my $(cfg)"}
    subprocess.run(["bash", str(out / "launch_torchtitan.sh"), "--training.steps", "7"], env=env, check=True, cwd=tmp_path)
    argv = json.loads(args_out.read_text())
    i = argv.index("-m")
    assert argv[i + 1 : i + 6] == ["torchtitan.train", "--module", "llama3", "--config", "my $(cfg)"]
    assert argv[i + 6 : i + 8] == ["--training.steps", "7"]
    assert argv[i + 8 :] == overrides(plan)
    assert not list(tmp_path.rglob("PWNED*"))


def test_non_llama_module_names_are_refused():
    plan = plan_of("gpt2", "gpt2-tiny", gpus="2xH100", pp=2, schedule="1f1b")
    with pytest.raises(UsageError, match="not a torchtitan Llama module"):
        render(plan, "cmd")


def test_cli_plan_and_refusal(tmp_path):
    run = [sys.executable, "-m", "planner", "plan"]
    ok = subprocess.run(
        [*run, str(EXAMPLES / "llama.py"), "--model-arg", "preset=llama-tiny", "--gpus", "8xH100", "--engine", "torchtitan", "--out", str(tmp_path / "a")],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "a" / "launch_torchtitan.sh").is_file() and "No TOML" in (tmp_path / "a" / "README.md").read_text()
    bad = subprocess.run(
        [*run, str(EXAMPLES / "gpt2.py"), "--model-arg", "preset=gpt2-tiny", "--gpus", "2xH100", "--engine", "torchtitan", "--out", str(tmp_path / "b")],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "Traceback" not in bad.stderr and "torchtitan Llama module" in bad.stdout + bad.stderr


def _config_manager():
    try:
        import torchtitan.models.llama3.config_registry  # noqa: F401  (its imports are the optional dependencies)
        from torchtitan.config.manager import ConfigManager
    except Exception as exc:  # noqa: BLE001 - any missing optional dependency skips
        pytest.skip(f"torchtitan's ConfigManager is not importable: {exc}")
    return ConfigManager


@pytest.mark.parametrize("name", list(CASES))
def test_torchtitan_config_manager_parses_the_overrides(plans, name, tmp_path, monkeypatch):
    """torchtitan's own parser (ConfigManager.parse_args: tyro over the llama3 registry function, then
    Trainer.Config's validation) reads the rendered overrides back as the plan."""
    config_manager = _config_manager()
    monkeypatch.chdir(tmp_path)
    plan = plans[name]
    lay = plan.layout
    cfg = config_manager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel", *overrides(plan)])
    par, tr = cfg.parallelism, cfg.training
    assert par.pipeline_parallel_degree == lay.pp
    assert par.pipeline_parallel_schedule == SCHEDULE_NAMES[lay.schedule]
    assert par.pipeline_parallel_microbatch_size == lay.micro_batch
    assert par.module_fqns_per_model_part == stage_fqns(plan)
    assert (par.data_parallel_replicate_degree, par.data_parallel_shard_degree) == ((1, lay.dp) if lay.zero == 3 else (lay.dp, 1))
    assert par.tensor_parallel_degree == 1 and par.context_parallel_degree == 1
    assert tr.local_batch_size // par.pipeline_parallel_microbatch_size == lay.num_microbatches
    assert tr.global_batch_size == lay.global_batch == tr.local_batch_size * lay.dp
    assert tr.seq_len == plan.model["seq_len"]
    ac = cfg.activation_checkpoint
    assert (type(ac).__qualname__ == "FullAC.Config") if lay.recompute == "full" else (ac is None)
    world = lay.pp * par.data_parallel_replicate_degree * par.data_parallel_shard_degree
    assert world == lay.pp * lay.dp == 8
