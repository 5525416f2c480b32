"""Megatron's --recompute-modules (selective recomputation of named modules): what each modelled module stops keeping
(closed forms by hand; MLA's against megatron-core's own CheckpointWithoutOutput in test_megatron_moe_activations),
what it recomputes (FLOPs by hand, priced by the time model), the flags (megatron-core's TransformerConfig, Megatron-LM's
validate_args where a checkout is named, our MEG020 rule), plan.json round trips, validate and the CLI's refusals."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from planner import hardware
from planner.engines import get_engine
from planner.engines.megatron.activations import LayerShape, kept_bytes, layer_saved
from planner.engines.megatron.architecture import Flag, check_megatron_args
from planner.engines.megatron.core_check import core_config
from planner.engines.megatron.moe_activations import MLAShape, mla_attention_saved
from planner.engines.megatron.recompute import dense_mlp_work, mla_up_proj_work
from planner.engines.megatron.rules import megatron_recompute_work
from planner.errors import UsageError
from planner.solve.plan import Layout, Plan
from planner.solve.search import Context, evaluate_layout
from planner.solve.settings import Settings
from planner.solve.timing import bytes_time, ops_time
from tests.engines.test_megatron_moe_activations import DEEPSEEK_V3
from tests.engines.test_render_megatron_moe import load, rendered
from tests.mlm_validate import megatron_lm_config

ROOT = Path(__file__).resolve().parents[2]
LLAMA = {
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_query_groups": 8,
    "ffn_hidden_size": 14336,
    "normalization": "RMSNorm",
    "activation": "swiglu",
    "dropout": 0.0,
}

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# --------------------------------------------------------------------------- what the modules drop, by hand


@pytest.mark.parametrize("tp,sp", [(1, False), (4, True)])
def test_dense_mlp_recompute_keeps_only_the_mlp_input(tp, sp):
    """Llama-3-8B-shaped layer, s 8192, b 1: ``mlp`` drops the pre-MLP norm's 1/sigma (4 T), its output (2 T h), FC1's
    output (2 x 2 S ffn / tp, SwiGLU) and the activation output (2 S ffn / tp); the norm input (the checkpoint's input)
    stays; core_attn alone drops only the softmax statistics (4 S heads / tp)."""
    s, h, ffn = 8192, 4096, 14336
    T = s // (tp if sp else 1)
    shape = LayerShape.from_architecture(LLAMA)
    full = kept_bytes(layer_saved(shape, s, 1, tp, sp))
    mlp = layer_saved(shape, s, 1, tp, sp, recompute="selective", modules=frozenset({"mlp"}))
    assert full - kept_bytes(mlp, "selective") == 4 * T + 2 * T * h + 2 * 2 * s * ffn / tp + 2 * s * ffn / tp
    both = layer_saved(shape, s, 1, tp, sp, recompute="selective", modules=frozenset({"mlp", "core_attn"}))
    assert kept_bytes(mlp, "selective") - kept_bytes(both, "selective") == 4 * s * 32 / tp
    # under FP8 what goes is what FP8 would have kept: the norm output and the activation output at 1 byte each
    assert (
        kept_bytes(layer_saved(shape, s, 1, tp, sp), fp8=True) - kept_bytes(mlp, "selective", fp8=True) == 4 * T + T * h + 2 * 2 * s * ffn / tp + s * ffn / tp
    )


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True)])
def test_deepseek_mla_up_proj_by_hand(tp, sp):
    """DeepSeek-V3 MLA, s 4096, b 1: ``mla_up_proj`` drops q and k (2 S H 192 each), v (2 S H 128) and RoPE's cos/sin
    (4 x 2 s 64); it keeps the kv latent's whole storage (2 T (512 + 64), was its 2 T 512 copy) and, under sequence
    parallelism, the gathered k_pos_emb (2 S 64). With the latent norms it also drops their 1/sigma (4 T each) and
    normed latents (2 T (1536 + 512))."""
    s = 4096
    T = s // (tp if sp else 1)
    H = 128 // tp
    shape, mla = LayerShape.from_architecture(DEEPSEEK_V3), MLAShape.from_architecture(DEEPSEEK_V3)
    full = kept_bytes(mla_attention_saved(shape, mla, s, 1, tp, sp))
    up = mla_attention_saved(shape, mla, s, 1, tp, sp, recompute="selective", modules=frozenset({"mla_up_proj"}))
    gathered = 2 * s * 64 if sp and tp > 1 else 0
    assert full - kept_bytes(up, "selective") == 2 * 2 * s * H * 192 + 2 * s * H * 128 + 4 * 2 * s * 64 - 2 * T * 64 - gathered
    normed = MLAShape.from_architecture({**DEEPSEEK_V3, "qk_layernorm": True})
    full_n = kept_bytes(mla_attention_saved(shape, normed, s, 1, tp, sp))
    up_n = kept_bytes(mla_attention_saved(shape, normed, s, 1, tp, sp, recompute="selective", modules=frozenset({"mla_up_proj"})), "selective")
    assert full_n - up_n == full - kept_bytes(up, "selective") + 2 * 4 * T + 2 * T * (1536 + 512)


# --------------------------------------------------------------------------- what they recompute


def test_recomputed_flops_by_hand():
    """mla_up_proj: 2 S q_lora H (qk + rope) + 2 S kv_lora H (qk + v); mlp: 2 S h ffn / tp x (2 + 1) with SwiGLU."""
    s, tp = 4096, 2
    H = 128 // tp
    w = mla_up_proj_work(LayerShape.from_architecture(DEEPSEEK_V3), MLAShape.from_architecture(DEEPSEEK_V3), s, 1, tp, True)
    assert w.gemm_flops == (2 * s * 1536 * H * 192, 2 * s * 512 * H * 256)
    assert w.collectives == pytest.approx(0.5 * (1536 + 512) / 7168)
    m = dense_mlp_work(LayerShape.from_architecture(LLAMA), 8192, 1, 4, True)
    assert m.gemm_flops == (2 * 8192 * 4096 * 14336 / 4 * 2, 2 * 8192 * 4096 * 14336 / 4) and m.collectives == 1.0


@pytest.fixture(scope="module")
def deepseek_tiny():
    from tests.conftest import costs_of

    return costs_of("moe", "deepseek-tiny")


def _priced(costs, modules, recompute="selective", bounds=None):
    cluster = hardware.parse_gpus("2xH100-SXM")
    ctx = Context(costs, cluster, Settings.of(engine="megatron", global_batch=8, mem_target=1.0), get_engine("megatron"))
    lay = Layout("megatron", 2, 1, 1, 1, 1, 8, 8, "1f1b", recompute, 0, recompute_modules=modules)
    ev = evaluate_layout(ctx, lay, costs.dtype, bounds)
    assert not hasattr(ev, "reason"), ev
    return ev, cluster.device_of(0)


def test_recompute_time_is_the_modules_work(deepseek_tiny):
    """The recomputation the time model charges, per stage: core_attn's traced attention core plus, for mla_up_proj
    and mlp, the closed-form work priced GEMM by GEMM (ops_time), kernel by kernel, at micro-batch 1 (tp 1: no
    collectives); the modules add up, and nothing else in the step changes but the recomputation."""
    core, dev = _priced(deepseek_tiny, ())
    up, _ = _priced(deepseek_tiny, ("mla_up_proj", "mlp"), bounds=core.bounds)
    both, _ = _priced(deepseek_tiny, ("core_attn", "mla_up_proj", "mlp"), bounds=core.bounds)
    work = megatron_recompute_work(deepseek_tiny, 1, False, 1, frozenset({"mla_up_proj", "mlp"}))
    assert work is not None and sum(1 for w in work if w.gemm_flops) == 4 + 1  # 4 MLA layers, 1 dense MLP
    floor = dev.kernel_floor_s
    expected = [
        ops_time(w.gemm_flops, sum(w.gemm_flops), dev, "bf16", floor) + bytes_time(w.kernel_bytes, sum(w.kernel_bytes), dev, floor) if w.gemm_flops else 0.0
        for w in work
    ]
    for j, (a, c) in enumerate(zip(up.bounds, up.bounds[1:])):
        assert up.stage_recompute[j] == pytest.approx(sum(expected[a:c]), rel=1e-12)
        assert both.stage_recompute[j] == pytest.approx(up.stage_recompute[j] + core.stage_recompute[j], rel=1e-9)


def test_modules_lower_the_peak_by_what_they_drop(deepseek_tiny):
    """With the split fixed, each stage's activation bytes per micro-batch fall by exactly what the closed form says the
    modules drop, block by block (4 MLA layers: q, k, v, RoPE's tables; the dense first layer's MLP too); the peak
    falls, and stays above full recomputation's."""
    from planner.engines.megatron.activations import CORE_ATTN
    from planner.engines.megatron.moe_activations import megatron_layer_saved
    from planner.engines.megatron.rules import megatron_blocks

    core, _ = _priced(deepseek_tiny, ())
    modules = frozenset({"mla_up_proj", "mlp"})
    up, _ = _priced(deepseek_tiny, tuple(sorted(modules)), bounds=core.bounds)
    full, _ = _priced(deepseek_tiny, (), "full", bounds=core.bounds)
    arch, seq = deepseek_tiny.architecture, deepseek_tiny.seq_len
    blocks, is_moe = megatron_blocks(deepseek_tiny)

    def dropped(moe):
        kept = [kept_bytes(megatron_layer_saved(arch, moe, seq, 1, recompute="selective", modules=m), "selective") for m in (CORE_ATTN, modules)]
        return kept[0] - kept[1]

    for j, (a, c) in enumerate(zip(core.bounds, core.bounds[1:])):
        expected = sum(dropped(moe) for ks, moe in zip(blocks.values(), is_moe) if a <= ks[0] < c)
        assert expected > 0 and core.act_per_mb[j] - up.act_per_mb[j] == pytest.approx(expected, rel=1e-12)
    peak = [max(r["activations"] for r in ev.rank_memory) for ev in (core, up, full)]
    assert peak[0] > peak[1] > peak[2]


# --------------------------------------------------------------------------- flags: rendered, Megatron's checks


def test_rendered_modules_are_what_megatron_core_recomputes():
    plan = load("deepseek_tiny_pp2", recompute="selective", recompute_modules=("mla_up_proj", "mlp"))
    args = rendered(plan)
    assert args.value("--recompute-granularity") == "selective" and args.get("--recompute-modules").values == ("mla_up_proj", "mlp")
    assert check_megatron_args(args) == []
    cfg = core_config(args)
    assert cfg.recompute_granularity == "selective" and cfg.recompute_modules == ["mla_up_proj", "mlp"]


def test_megatron_lm_validate_args_takes_the_rendered_modules():
    plan = load("deepseek_tiny_pp2", recompute="selective", recompute_modules=("mla_up_proj", "mlp"))
    args = rendered(plan)
    margs, lm_cfg = megatron_lm_config(args.argv(), plan.layout.world)
    assert margs.recompute_modules == ["mla_up_proj", "mlp"] and lm_cfg.recompute_modules == ["mla_up_proj", "mlp"]


def test_default_selective_writes_no_module_list():
    assert not rendered(load("deepseek_tiny_pp2", recompute="selective")).has("--recompute-modules")


def test_mla_up_proj_without_mla_is_refused_by_megatron_core_and_by_meg020():
    """The renderer refuses to write it (our rules run first); megatron-core refuses the same flags written by hand."""
    with pytest.raises(UsageError, match="MEG020"):
        rendered(load("moe_tiny_tp2", recompute="selective", recompute_modules=("mla_up_proj",)))
    args = rendered(load("moe_tiny_tp2", recompute="selective"))
    args = dataclasses.replace(args, flags=args.flags + (Flag("--recompute-modules", ("mla_up_proj",), None),))
    with pytest.raises(ValueError, match="mla_up_proj"):
        core_config(args)
    assert [f.rule for f in check_megatron_args(args)] == ["MEG020"]
    # a module list without selective granularity does nothing in Megatron: MEG020 says so
    plain = rendered(load("moe_tiny_tp2"))
    plain = dataclasses.replace(plain, flags=plain.flags + (Flag("--recompute-modules", ("mlp",), None),))
    assert [f.rule for f in check_megatron_args(plain)] == ["MEG020"]


def test_plan_json_round_trips_the_modules():
    plan = load("deepseek_tiny_pp2", recompute="selective", recompute_modules=("mla_up_proj",))
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back.layout == plan.layout and back.layout.recompute_modules == ("mla_up_proj",)
    assert Layout.from_dict({k: v for k, v in plan.layout.to_dict().items() if k != "recompute_modules"}).modules_recomputed == {"core_attn"}
    assert "recompute=selective(mla_up_proj)" in plan.layout.short()


# --------------------------------------------------------------------------- validate and the CLI


def test_validate_passes_the_planned_modules_and_flags_a_dropped_one(tmp_path):
    from planner.check.validate import Options, validate
    from planner.planning import plan_model
    from planner.render import write_plan_dir
    from planner.solve.settings import Settings

    model = tmp_path / "llama.py"
    shutil.copy(ROOT / "examples" / "llama.py", model)
    req = Settings.of(
        model_file=str(model), model_args={"preset": "llama-tiny"}, gpus="4xA100", engine="megatron", pp=2, recompute="selective", recompute_modules=("mlp",)
    )
    plan = plan_model(req)[0]
    assert plan.layout.recompute_modules == ("mlp",) and plan.inputs["recompute_modules"] == ["mlp"]
    out = tmp_path / "plan"
    write_plan_dir(out, plan, "planner plan llama.py")
    report = validate([out], Options(model=str(model)))
    assert [f.rule for f in report.findings if f.severity == "error"] == [], "\n".join(map(str, report.findings))
    assert [round(t) for t in report.memory[0].rank_total_bytes] == [r.memory_bytes["total"] for r in plan.ranks]
    script = out / "pretrain_gpt.sh"
    script.write_text(script.read_text().replace(" \\\n  --recompute-modules mlp", "").replace("--recompute-modules mlp", ""))
    assert "PLAN002" in {f.rule for f in validate([out], Options(model=str(model))).findings}


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--recompute-modules", "core_atn"], "Did you mean 'core_attn'"),
        (["--recompute-modules", "moe_act"], "does not model"),
        (["--recompute-modules", "mlp,mlp"], "twice"),
        (["--recompute-modules", "mlp", "--recompute", "full"], "--recompute selective"),
        (["--recompute-modules", "mlp", "--engine", "deepspeed"], "Megatron-LM option"),
        (["--recompute-modules", "mla_up_proj"], "multi-latent attention"),
    ],
)
def test_cli_refuses_what_megatron_or_the_planner_cannot_recompute(argv, words):
    from typer.testing import CliRunner

    from planner.cli import app

    base = ["plan", str(ROOT / "examples" / "llama.py"), "--model-arg", "preset=llama-tiny", "--gpus", "4xA100"]
    engine = [] if "--engine" in argv else ["--engine", "megatron"]
    r = CliRunner().invoke(app, base + engine + argv)
    assert r.exit_code == 2, r.output
    assert words in r.output.replace("\n", " ")


def test_other_engines_refuse_modules_in_a_layout():
    from planner.cli_values import recompute_modules
    from tests.conftest import costs_of

    lay = Layout("torch", 2, 1, 1, 1, 1, 8, 8, "1f1b", "selective", 0, recompute_modules=("mlp",))
    assert any("--recompute-modules" in p for p in get_engine("torch").layout_problems(lay, costs_of("llama", "llama-tiny")))
    with pytest.raises(UsageError):
        recompute_modules(["mlp"], None, "torch")


def test_the_recorded_command_remakes_the_plan(tmp_path, monkeypatch):
    """The command in the plan directory's headers names the modules, and running it there writes the same plan.json."""
    import shlex

    from typer.testing import CliRunner

    from planner.cli import app

    model = tmp_path / "moe.py"
    shutil.copy(ROOT / "examples" / "moe.py", model)
    out = tmp_path / "plan"
    argv = ["plan", str(model), "--model-arg", "preset=deepseek-tiny", "--gpus", "8xH100", "--engine", "megatron", "--pp", "2"]
    r = CliRunner().invoke(app, argv + ["--recompute-modules", "mla_up_proj", "--recompute-modules", "mlp", "--out", str(out), "-q"])
    assert r.exit_code == 0, r.output
    first = (out / "plan.json").read_text()
    assert json.loads(first)["layout"]["recompute_modules"] == ["mla_up_proj", "mlp"]
    header = next(line for line in (out / "pretrain_gpt.sh").read_text().splitlines() if line.startswith("# Generated by planner"))
    command = shlex.split(header.split(": ", 1)[1])
    assert command[command.index("--recompute-modules") + 1] == "mla_up_proj,mlp"
    monkeypatch.chdir(out)
    r = CliRunner().invoke(app, command[1:] + ["-q"])
    assert r.exit_code == 0, r.output
    assert (out / "plan.json").read_text() == first
