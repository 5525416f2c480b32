"""FP8 and precision memory as Megatron-LM and Transformer Engine allocate it, checked against closed forms written out
by hand (bytes per parameter; the GEMM inputs of a transformer layer), Megatron-core's own config checks for the flag
the renderer writes, and the command line's refusals (exit 2)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from planner import hardware
from planner.engines import get_engine
from planner.engines.megatron.architecture import check_megatron_args
from planner.engines.megatron.render import render as render_megatron
from planner.engines.megatron.script import parse_megatron_args
from planner.solve.memory import activation_bytes_per_microbatch, saved_bytes, state_recipe
from planner.solve.plan import Layout, Plan
from planner.solve.search import Context, evaluate_layout
from planner.solve.settings import Settings
from planner.solve.timing import shard_costs

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "megatron"
TINY = {"n_layers": 4, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 176, "seq_len": 32}  # llama-tiny


def _lay(**kw) -> Layout:
    base = Layout("megatron", 2, 8, 4, 1, 1, 8, 32, "1f1b", "none", 1, True, fp8=True)
    return replace(base, **kw)


@pytest.fixture(scope="module")
def tiny():
    from planner.model.analyze import analyze

    return analyze(ROOT / "examples" / "llama.py", {"preset": "llama-tiny"}, 1, "bf16").costs


@pytest.fixture(scope="module")
def gpt_tiny():
    from planner.model.analyze import analyze

    args = {"preset": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "seq_len": 32, "vocab_size": 256}
    return analyze(ROOT / "examples" / "gpt2.py", args, 1, "bf16").costs


# --------------------------------------------------------------------------- model state, bytes per parameter


@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_fp8_bytes_per_parameter(d):
    """Per parameter of a transformer block's linear layer (an FP8 GEMM weight): bf16 weight 2 + TE's cached FP8 copy
    and FP8 transpose 2; with FP8 primary weights the FP8 weight 1 + its transpose 1 and no bf16 weight. Embeddings,
    the output layer and norms stay bf16 (2). Main gradients 4 (fp32) or 2 (bf16); fp32 master 4 + Adam 8 over d."""
    meg = get_engine("megatron")

    def per(lay: Layout) -> tuple[float, float]:
        """(bytes of another parameter, bytes of an FP8 GEMM weight)"""
        r = meg.state_recipe("bf16", lay.zero, "adam", lay)
        return sum(r.per_param(d)), sum(r.per_param(d)) + r.fp8_gemm_bytes

    assert per(_lay(fp8=False)) == pytest.approx((2 + 4 + 12 / d,) * 2)
    assert per(_lay()) == pytest.approx((2 + 4 + 12 / d, 2 + 2 + 4 + 12 / d))
    # bf16 main gradients with the distributed optimizer run the precision-aware optimizer, which keeps the fp32 master
    # as 16-bit remainders: master 2 + Adam 8 over d
    assert per(_lay(main_grads_dtype="bf16")) == pytest.approx((2 + 2 + 10 / d, 2 + 2 + 2 + 10 / d))
    assert per(_lay(main_grads_dtype="bf16", zero=0)) == pytest.approx((2 + 2 + 12, 2 + 2 + 2 + 12))  # --grad-reduce-in-bf16
    assert per(_lay(fp8_param_gather=True)) == pytest.approx((2 + 4 + 12 / d, 1 + 1 + 4 + 12 / d))
    # FP8 primary weights: the master stays whole fp32 (the remainder needs a bf16 weight to complete it)
    assert per(_lay(fp8_param_gather=True, main_grads_dtype="bf16")) == pytest.approx((2 + 2 + 12 / d, 1 + 1 + 2 + 12 / d))
    # what the distributed optimizer all-gathers after the step: FP8 GEMM weights in FP8 with --fp8-param-gather
    r = meg.state_recipe("bf16", 1, "adam", _lay(fp8_param_gather=True))
    assert (r.weight_bytes, r.fp8_gemm_gather_bytes) == (2, 1)
    assert meg.state_recipe("bf16", 1, "adam", _lay()).fp8_gemm_gather_bytes is None


def test_megatron_keeps_master_remainders_under_the_precision_aware_optimizer(monkeypatch):
    """Megatron-core's own OptimizerConfig: store_param_remainders is on by default, and the precision-aware optimizer
    hands the master weights to TE's FusedAdam (which stores the remainders) with no FP8 recipe or the delayed one the
    renderer writes, not with current scaling. TE is absent here: its FusedAdam is stood in for by a class with the
    signature OptimizerConfig inspects, and TE's version check answers as TE 2.x would."""
    import types

    import torch
    from megatron.core.optimizer import OptimizerConfig, optimizer_config

    class FusedAdam:
        def __init__(self, params, master_weight_dtype=None, exp_avg_dtype=None, exp_avg_sq_dtype=None, use_decoupled_grad=False):
            pass

    te = types.ModuleType("transformer_engine")
    te_pt = types.ModuleType("transformer_engine.pytorch")
    te_opt = types.ModuleType("transformer_engine.pytorch.optimizers")
    te_opt.FusedAdam = FusedAdam
    for name, mod in (("transformer_engine", te), ("transformer_engine.pytorch", te_pt), ("transformer_engine.pytorch.optimizers", te_opt)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(optimizer_config, "is_te_min_version", lambda v: True)
    kw = dict(optimizer="adam", use_distributed_optimizer=True, use_precision_aware_optimizer=True, bf16=True, main_grads_dtype=torch.bfloat16)
    for recipe in (None, "delayed"):
        cfg = OptimizerConfig(**kw, fp8_recipe=recipe)
        assert cfg.store_param_remainders and cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    assert not OptimizerConfig(**kw, fp8_recipe="tensorwise").use_precision_aware_optimizer_no_fp8_or_ds_fp8
    # and the renderer writes the precision-aware optimizer exactly where the engine counts remainders
    plan = _plan(zero=1, main_grads_dtype="bf16")
    args = parse_megatron_args(render_megatron(plan, "planner plan", None)["pretrain_gpt.sh"])
    assert args.has("--use-precision-aware-optimizer") and args.value("--fp8-recipe") is None
    assert get_engine("megatron").state_recipe("bf16", 1, "adam", plan.layout).master_bytes == 2


def test_fp8_primary_weights_need_fp8_and_half_precision():
    with pytest.raises(ValueError, match="FP8 training"):
        state_recipe("bf16", fp8=False, fp8_params=True)
    with pytest.raises(ValueError, match="half-precision"):
        state_recipe("fp32", fp8=True, fp8_params=True)


def test_fp8_param_gather_rules(tiny):
    meg = get_engine("megatron")
    lay = Layout("megatron", 1, 1, 2, 1, 1, 4, 8, "1f1b", "none", 1, fp8=True, fp8_param_gather=True)
    assert meg.layout_problems(lay, tiny) == []
    assert any("distributed optimizer" in p for p in meg.layout_problems(replace(lay, zero=0), tiny))
    assert any("needs FP8 training" in p for p in meg.layout_problems(replace(lay, fp8=False), tiny))
    assert "fp8-params" in lay.short()


# --------------------------------------------------------------------------- saved activations under FP8


def test_gemm_inputs_of_a_llama_layer_written_out_by_hand(tiny):
    """The inputs the layer's weight GEMMs alone keep, bf16 (2 bytes), s = 32, b = 1: attention = norm output (s x h, read
    by wq, wk, wv) + the projection's input (s x heads x head_dim); MLP = norm output (s x h, read by w1, w3) + w2's
    input (s x ffn). Under FP8 each is kept in 1 byte; the output head stays bf16 (Megatron's ColumnParallelLinear)."""
    s, h, f = TINY["seq_len"], TINY["dim"], TINY["ffn_dim"]
    attn, mlp = tiny.layers[1], tiny.layers[2]
    assert (attn.kind, mlp.kind) == ("attention", "mlp")
    assert attn.gemm_saved_bytes == (s * h + s * h) * 2 and attn.gemm_shared_bytes == 0
    assert mlp.gemm_saved_bytes == (s * h + s * f) * 2 and mlp.gemm_shared_bytes == 0
    assert saved_bytes(attn, fp8=True) == attn.saved_bytes - (s * h + s * h)
    assert saved_bytes(mlp, fp8=True) == mlp.saved_bytes - (s * h + s * f)
    head = tiny.layers[-1]
    assert head.kind == "head" and head.gemm_saved_bytes > 0 and saved_bytes(head, fp8=True) == head.saved_bytes
    per_layer = 2 * s * h + s * h + s * f  # bytes FP8 saves per transformer layer
    full = activation_bytes_per_microbatch(tiny, 0, tiny.n, "none")
    assert activation_bytes_per_microbatch(tiny, 0, tiny.n, "none", fp8=True) == full - TINY["n_layers"] * per_layer


def test_an_input_another_operator_also_keeps_is_kept_twice_under_fp8(gpt_tiny):
    """GPT-2's projection reads the flash-attention output itself (its transpose is already contiguous): attention keeps
    it in bf16 for its own backward and TE adds the projection's FP8 copy (+1 byte per element); the QKV input (ln_1's
    output, s x h) and the MLP's (ln_2's output s x h, GELU's output s x 4h) shrink to 1 byte."""
    s, h = 32, 64
    attn, mlp = gpt_tiny.layers[1], gpt_tiny.layers[2]
    assert attn.gemm_saved_bytes == s * h * 2 and attn.gemm_shared_bytes == s * h * 2
    assert saved_bytes(attn, fp8=True) == attn.saved_bytes - s * h + s * h
    assert mlp.gemm_saved_bytes == (s * h + s * 4 * h) * 2
    assert saved_bytes(mlp, fp8=True) == mlp.saved_bytes - (s * h + s * 4 * h)


def test_gemm_inputs_scale_with_the_micro_batch_and_shard_with_sequence_parallelism(tiny):
    attn = tiny.layers[1]
    assert tiny.scaled(4).layers[1].gemm_saved_bytes == 4 * attn.gemm_saved_bytes
    assert shard_costs(tiny, 2, sequence_parallel=True).layers[1].gemm_saved_bytes == attn.gemm_saved_bytes // 2
    assert shard_costs(tiny, 2, sequence_parallel=False).layers[1].gemm_saved_bytes == attn.gemm_saved_bytes


def test_priced_fp8_layout_holds_the_fp8_activations_and_state(tiny):
    """evaluate_layout's per-micro-batch activations and weights under FP8 against the closed forms above."""
    cluster = hardware.parse_gpus("2xH100-SXM")
    ctx = Context(tiny, cluster, Settings.of(engine="megatron", global_batch=8, mem_target=1.0, fp8=True), get_engine("megatron"))
    base = Layout("megatron", 1, 1, 2, 1, 1, 4, 8, "1f1b", "none", 1)
    bf16 = evaluate_layout(ctx, base, "bf16")
    fp8 = evaluate_layout(ctx, replace(base, fp8=True), "bf16")
    fp8p = evaluate_layout(ctx, replace(base, fp8=True, fp8_param_gather=True, main_grads_dtype="bf16"), "bf16")
    s, h, f = TINY["seq_len"], TINY["dim"], TINY["ffn_dim"]
    # Megatron's own TE layer (tests/engines/test_megatron_activations.py): the two norm outputs (2 s h each) and FC2's input
    # (2 s f) go to 1 byte, the attention output (2 s h) gains a 1-byte copy: s h + s f less per layer
    assert sum(bf16.act_per_mb) - sum(fp8.act_per_mb) == pytest.approx(TINY["n_layers"] * (s * h + s * f))
    prm = sum(bf16.stage_params)
    # the blocks' weights, per layer: wq h x h, wk and wv h x (h kv / heads) each, wo h x h, w1 and w3 h x ffn, w2, and
    # the two RMSNorm weights (h each, counted with them)
    gemm = TINY["n_layers"] * (2 * h * h + 2 * h * h * TINY["n_kv_heads"] // TINY["n_heads"] + 3 * h * f + 2 * h)
    assert bf16.stage_memory[0]["weights"] == pytest.approx(prm * 2)
    assert fp8.stage_memory[0]["weights"] == pytest.approx(prm * 2 + gemm * 2)  # + FP8 copy + FP8 transpose
    assert fp8p.stage_memory[0]["weights"] == pytest.approx(prm * 2)  # FP8 weight + FP8 transpose in the bf16's place
    assert fp8p.stage_memory[0]["grads"] == pytest.approx(prm * 2)
    assert fp8p.stage_memory[0]["optimizer"] == pytest.approx(prm * 12 / 2)
    for ev in (bf16, fp8, fp8p):  # the stage's parts add up to the static bytes the partition used
        assert ev.stage_memory[0]["buffers"] == pytest.approx(bf16.stage_memory[0]["buffers"])


# --------------------------------------------------------------------------- the rendered flag and Megatron's own checks


def _plan(**layout) -> Plan:
    d = copy.deepcopy(json.loads((FIXTURES / "llama7b.json").read_text()))
    d["layout"].update(layout)
    return Plan.from_dict(d)


def test_rendered_fp8_param_gather_passes_megatron_validation():
    from megatron.core.transformer import TransformerConfig

    from planner.engines.megatron.core_check import core_config

    plan = _plan(zero=1, fp8=True, fp8_param_gather=True, main_grads_dtype="bf16", overlap_grad_reduce=True, overlap_param_gather=True)
    args = parse_megatron_args(render_megatron(plan, "planner plan", None)["pretrain_gpt.sh"])
    assert args.has("--fp8-param-gather") and args.has("--use-distributed-optimizer") and args.value("--fp8-format") == "hybrid"
    assert check_megatron_args(args, plan.layout.world) == []
    cfg = core_config(args)
    # Megatron-LM passes --fp8-param-gather to TransformerConfig as fp8_param (arguments.py core_v0.16.1), which
    # accepts it with fp8 and refuses it without
    ok = replace(cfg, fp8=args.value("--fp8-format"), fp8_recipe=args.value("--fp8-recipe"), fp8_param=args.has("--fp8-param-gather"))
    assert isinstance(ok, TransformerConfig) and ok.fp8_param
    with pytest.raises(ValueError, match="fp8_param"):
        replace(cfg, fp8=None, fp8_param=True)
    # the same flag without FP8 or without the distributed optimizer is a finding (MEG041)
    for drop in ("--fp8-format", "--use-distributed-optimizer"):
        text = render_megatron(plan, "planner plan", None)["pretrain_gpt.sh"]
        lines = [ln for ln in text.splitlines() if not ln.strip().startswith(drop)]
        found = check_megatron_args(parse_megatron_args("\n".join(lines)), plan.layout.world)
        assert "MEG041" in {f.rule for f in found}, drop
    plain = parse_megatron_args(render_megatron(_plan(zero=1, fp8=True), "planner plan", None)["pretrain_gpt.sh"])
    assert not plain.has("--fp8-param-gather")


# --------------------------------------------------------------------------- command line


def _planner(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {"COLUMNS": "200", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "planner", *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def test_plan_with_fp8_param_gather_renders_the_flag_and_validates(tmp_path):
    """`--dtype fp8 --fp8-param-gather` plans only distributed-optimizer layouts, records the option in plan.json, writes
    Megatron's flag, and `planner validate` passes the plan it wrote (MEG041 and the memory check included)."""
    model = str(ROOT / "examples" / "llama.py")
    r = _planner("plan", model, "--model-arg", "preset=llama-tiny", "--gpus", "2xH100", "--engine", "megatron", "--dtype", "fp8",
                 "--fp8-param-gather", "--out", "p", "--quiet", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert doc["layout"]["fp8_param_gather"] is True and doc["layout"]["zero"] == 1 and doc["inputs"]["fp8_param_gather"] is True
    script = (tmp_path / "p" / "pretrain_gpt.sh").read_text()
    assert "--fp8-param-gather" in script and "--use-distributed-optimizer" in script
    r = _planner("validate", str(tmp_path / "p"), "--format", "json", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(
    "extra, says",
    [
        (("--engine", "megatron", "--dtype", "bf16"), "--dtype fp8"),
        (("--engine", "deepspeed", "--dtype", "fp8"), "Megatron-LM option"),
        (("--engine", "megatron", "--dtype", "fp8", "--zero", "0"), "distributed optimizer"),
    ],
    ids=["no-fp8", "deepspeed", "zero0"],
)
def test_cli_refuses_fp8_param_gather_where_megatron_cannot_run_it(tmp_path, extra, says):
    model = str(ROOT / "examples" / "llama.py")
    r = _planner("plan", model, "--model-arg", "preset=llama-tiny", "--gpus", "2xH100", "--fp8-param-gather", *extra, "--quiet", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr
