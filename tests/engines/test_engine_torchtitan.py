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
from planner.planning import plan_model
from planner.render import render_files, write_plan_dir
from planner.solve.schedules import SCHEDULE_INFO
from planner.solve.settings import Settings

ENGINE = get_engine("torchtitan")


def plan_of(example: str = "llama", preset: str = "llama-tiny", gpus: str = "8xH100", **pins):
    req = Settings.of(model_file=str(EXAMPLES / f"{example}.py"), model_args={"preset": preset}, gpus=gpus, engine="torchtitan", **pins)
    return plan_model(req)[0]


CASES = {
    "1f1b": dict(pp=2, dp=4, schedule="1f1b", zero=0),
    "gpipe_fsdp": dict(pp=2, dp=4, schedule="gpipe", zero=3),
    "interleaved": dict(pp=2, vp=2, dp=4, schedule="interleaved", zero=3, recompute="full"),
    "selective": dict(pp=2, dp=4, schedule="1f1b", zero=3, recompute="selective"),
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
    assert words[-1] == f"activation-checkpoint:{lay.recompute}"  # none, selective, full: the subcommand names of torchtitan 0.3.0
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
    req = Settings.of(model_file=str(model), model_args={"preset": "llama-tiny"}, gpus="8xH100", engine="torchtitan", pp=2, dp=4, schedule="1f1b")
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
    want = {"full": "FullAC.Config", "selective": "SelectiveAC.Config"}.get(lay.recompute)
    assert (type(ac).__qualname__ == want) if want else (ac is None)
    world = lay.pp * par.data_parallel_replicate_degree * par.data_parallel_shard_degree
    assert world == lay.pp * lay.dp == 8


# --------------------------------------------------------------------------- activation checkpointing


def _block_terms(preset: str = "llama-tiny", b: int = 2):
    """(costs at micro-batch b, and the closed forms of one Llama block: its input, the outputs SelectiveAC keeps and
    the FLOPs of the matmuls it recomputes) from the preset's shapes (examples/llama.py), bf16."""
    from examples.llama import PRESETS

    cfg = PRESETS[preset]
    h, heads, kv, f, s = cfg["dim"], cfg["n_heads"], cfg["n_kv_heads"], cfg["ffn_dim"], cfg["seq_len"]
    kv_dim = kv * h // heads
    costs = costs_of("llama", preset).scaled(b)
    tok = b * s
    x = 2 * tok * h
    # the mms of a block, in order: wq, wk, wv | wo | w1, w3, w2; the 1st, 3rd, 5th and 7th are kept
    kept_mm = 2 * tok * h + 2 * tok * kv_dim + 2 * tok * f + 2 * tok * h
    # the flash attention op's outputs: out (bf16), logsumexp (fp32, b x heads x s), and its philox seed and offset
    sdpa = 2 * tok * h + 4 * b * heads * s
    recomputed_flops = 2 * tok * h * kv_dim + 2 * tok * h * h + 2 * tok * h * f  # wk, wo, w3
    return costs, x, kept_mm, sdpa, recomputed_flops


def test_selective_ac_keeps_the_block_input_and_the_outputs_torchtitans_policy_saves():
    from planner.engines.torchtitan.checkpointing import checkpointed, selective_work

    costs, x, kept_mm, sdpa, recomputed = _block_terms()
    sac = checkpointed(costs, "selective")
    blocks = sorted({l.block for l in costs.layers if l.block})
    for blk in blocks:
        ks = [k for k, l in enumerate(costs.layers) if l.block == blk]
        kept = sum(sac.layers[k].saved_bytes for k in ks)
        assert kept == pytest.approx(x + kept_mm + sdpa, abs=64)  # + the philox seed and offset (a few bytes)
        work = selective_work(costs)
        assert sum(sum(work[k].gemm_flops) for k in ks) == pytest.approx(recomputed)
        full = sum(costs.layers[k].saved_bytes for k in ks)
        # while the block's backward runs its full saved set is rebuilt: the rest of it is in each piece's working set
        assert all(sac.layers[k].max_op_bytes == costs.layers[k].max_op_bytes + round(full - kept) for k in ks)
    outside = [k for k, l in enumerate(costs.layers) if l.block is None]
    assert all(sac.layers[k] == costs.layers[k] for k in outside)  # only the blocks are wrapped


def test_full_ac_keeps_each_block_input_only():
    from planner.engines.torchtitan.checkpointing import checkpointed

    costs, x, *_ = _block_terms()
    ckpt = checkpointed(costs, "full")
    for blk in sorted({l.block for l in costs.layers if l.block}):
        ks = [k for k, l in enumerate(costs.layers) if l.block == blk]
        assert sum(ckpt.layers[k].saved_bytes for k in ks) == x


def test_selective_is_searched_rendered_and_checked(tmp_path):
    from planner.check.validate import Options, validate

    plan = plan_of(gpus="8xH100", pp=2, dp=4, zero=3, schedule="1f1b")
    assert plan.layout.recompute in ENGINE.recompute_modes
    out = tmp_path / "plan"
    req = Settings.of(
        model_file=str(EXAMPLES / "llama.py"),
        model_args={"preset": "llama-tiny"},
        gpus="8xH100",
        engine="torchtitan",
        pp=2,
        dp=4,
        zero=3,
        recompute="selective",
    )
    write_plan_dir(out, plan_model(req)[0])
    script = out / "launch_torchtitan.sh"
    assert script.read_text().rstrip().endswith("activation-checkpoint:selective")
    found = validate([out], Options(model=str(EXAMPLES / "llama.py"), model_args={"preset": "llama-tiny"}))
    assert [f for f in found.findings if f.severity == "error"] == [], found.findings
    script.write_text(script.read_text().replace("activation-checkpoint:selective", "activation-checkpoint:full"))
    found = validate([out], Options())
    assert [f.rule for f in found.findings if f.severity == "error"] == ["TT001"]
    assert "activation-checkpoint is full but the plan renders selective" in [f for f in found.findings if f.rule == "TT001"][0].message


def test_llama3_8b_on_8_h100_plans_with_selective_ac():
    """The issue's case, torchtitan's own 8-GPU benchmark shape (Llama 3.1 8B, FSDP 8, local batch 2, 8,192 tokens):
    refused without checkpointing, planned with torchtitan's default selective AC."""
    args = {"preset": "llama-7b", "n_kv_heads": 8, "ffn_dim": 14336, "vocab_size": 128256, "seq_len": 8192}
    req = Settings.of(
        model_file=str(EXAMPLES / "llama.py"),
        model_args=args,
        gpus="8xH100",
        engine="torchtitan",
        pp=1,
        dp=8,
        zero=3,
        micro_batch=2,
        global_batch=16,
        recompute="selective",
        mem_target=1.0,
    )
    plan = plan_model(req)[0]
    sel = plan.ranks[0].memory_bytes["total"]
    full = plan_model(req.but(recompute="full"))[0].ranks[0].memory_bytes["total"]
    assert full < sel < 79 * 2**30
