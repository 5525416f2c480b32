"""The activations one of Megatron's own transformer layers saves, checked against Korthikanti et al. 2022 (arXiv
2205.05198, section 4.1 and eqs. 2-6) term by term, and against the TE layer's closed form written out by hand; the
engine hook changes only Megatron's plans."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from planner import hardware
from planner.engines import get_engine
from planner.engines.megatron.activations import LayerShape, kept_bytes, layer_saved
from planner.engines.megatron.rules import megatron_layer_activations
from planner.solve.memory import range_matrices
from planner.solve.plan import Layout
from planner.solve.search import Context, evaluate_layout
from planner.solve.settings import Settings

GPT3 = {"hidden_size": 12288, "num_attention_heads": 96, "normalization": "LayerNorm", "activation": "gelu", "dropout": 0.1}
LLAMA70 = {
    "hidden_size": 8192,
    "num_attention_heads": 64,
    "num_query_groups": 8,
    "ffn_hidden_size": 28672,
    "normalization": "RMSNorm",
    "activation": "swiglu",
    "dropout": 0.0,
}


def _named(terms):
    return {t.name: t.bytes for t in terms}


def _korthikanti(s, b, h, a, t, sp):
    """Korthikanti's per-layer activation bytes: eq. 2 (t = 1), eq. 3 (tensor parallel), eq. 5 (and sequence parallel)."""
    if sp or t == 1:
        return s * b * h * (34 + 5 * a * s / h) / t
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


@pytest.mark.parametrize("t,sp", [(1, False), (8, False), (4, True), (8, True)])
def test_explicit_attention_gpt_layer_is_korthikanti_term_by_term(t, sp):
    """GPT-3 175B shape, s 2048, b 1, explicit attention and dropout (their assumptions). Section 4.1: attention block
    11 sbh + 5 as^2 b (QKV input 2, QK^T's q and k 4, softmax output 2 as^2 b, its dropout mask as^2 b and output
    2 as^2 b, v 2, the projection's input 2, the dropout mask 1), MLP 19 sbh (FC1 input 2, GeLU input 8, FC2 input 8,
    mask 1), two LayerNorms 4 sbh; the norms' fp32 statistics are beyond their count."""
    s, b, h, a = 2048, 1, 12288, 96
    terms = layer_saved(LayerShape.from_architecture(GPT3), s, b, t, sp, attention="explicit")
    n = _named(terms)
    r = s * b * h / (t if sp else 1)  # residual-stream elements per GPU
    split = s * b * h / t
    ss = a * s * s * b / t
    attention = 2 * r + 4 * split + 2 * ss + ss + 2 * ss + 2 * split + 2 * split + 1 * r
    assert sum(
        n[k] for k in n if k.startswith(("attention norm output", "q", "k", "softmax", "v", "attention output", "attention dropout mask"))
    ) == pytest.approx(attention)
    mlp = 2 * r + 8 * split + 8 * split + 1 * r
    assert n["mlp norm output (GEMM input)"] + n["FC1 output (activation input)"] + n["activation output (FC2 input)"] + n["mlp dropout mask"] == pytest.approx(
        mlp
    )
    assert n["attention norm input"] + n["mlp norm input"] == pytest.approx(4 * r)
    stats = 2 * (2 * 4 * s * b / (t if sp else 1))  # mean and 1/sigma, fp32, per token, two LayerNorms
    assert n["attention norm statistics"] + n["mlp norm statistics"] == pytest.approx(stats)
    assert kept_bytes(terms) - stats == pytest.approx(_korthikanti(s, b, h, a, t, sp))
    # selective recomputation (eq. 6 with sequence parallelism): the 5 as^2 b are recomputed
    assert kept_bytes(terms, "selective") - stats == pytest.approx(_korthikanti(s, b, h, a, t, sp) - 5 * ss)


@pytest.mark.parametrize("t", [4, 8])
def test_te_gpt_layer_with_flash_attention(t):
    """Megatron's TE GPT-3 175B layer with sequence parallelism: Korthikanti's 34 sbh/t without the s x s terms, plus the
    fp32 softmax statistics (a/t per token) and norm statistics; FP8: the norm outputs (2 + 2) and FC2's input (8) in
    1 byte, the attention output (2) gains a 1-byte copy: 34 - 6 + 1 = 29 sbh/t."""
    s, b, h, a = 2048, 1, 12288, 96
    terms = layer_saved(LayerShape.from_architecture(GPT3), s, b, t, True)
    lse = 4 * s * b * a / t
    stats = 2 * 2 * 4 * s * b / t
    sbh = s * b * h / t
    assert kept_bytes(terms) == pytest.approx(34 * sbh + lse + stats)
    assert kept_bytes(terms, fp8=True) == pytest.approx(29 * sbh + lse + stats)
    # selective: the softmax statistics go; the output is then the projection's alone (FP8: only its 1-byte copy)
    assert kept_bytes(terms, "selective") == pytest.approx(34 * sbh + stats)
    sel = layer_saved(LayerShape.from_architecture(GPT3), s, b, t, True, recompute="selective")
    assert kept_bytes(sel, "selective", fp8=True) == pytest.approx(27 * sbh + stats)  # 20 + 14 / 2


@pytest.mark.parametrize("t", [4, 8])
def test_te_llama3_70b_layer(t):
    """Llama 3 70B (GQA 64/8 heads of 128, SwiGLU 28672, RMSNorm, no dropout), s 8192, b 1, sequence parallel, in
    sbh/t: norm inputs 2 + 2, norm outputs 2 + 2, q 2, k and v 2 x 1/8 each, attention output 2, FC1's output
    2 x 2 x 3.5, FC2's input 2 x 3.5: 33.5; FP8: the norm outputs and FC2's input (11) halve and the attention output
    gains 1: 29; no dropout masks."""
    s, b, h, a = 8192, 1, 8192, 64
    terms = layer_saved(LayerShape.from_architecture(LLAMA70), s, b, t, True)
    assert not any("dropout" in x.name for x in terms)
    sbh = s * b * h / t
    lse = 4 * s * b * a / t
    stats = 2 * 4 * s * b / t  # 1/sigma, fp32, two RMSNorms
    assert kept_bytes(terms) == pytest.approx(33.5 * sbh + lse + stats)
    assert kept_bytes(terms, fp8=True) == pytest.approx(29 * sbh + lse + stats)
    sel = layer_saved(LayerShape.from_architecture(LLAMA70), s, b, t, True, recompute="selective")
    assert kept_bytes(sel, "selective") == pytest.approx(33.5 * sbh + stats)
    assert kept_bytes(sel, "selective", fp8=True) == pytest.approx(27 * sbh + stats)  # 20.5 + 13 / 2


# --------------------------------------------------------------------------- the engine hook


@pytest.fixture(scope="module")
def tiny():
    from tests.conftest import costs_of

    return costs_of("llama", "llama-tiny")


def _ctx(costs, engine, fp8=False):
    cluster = hardware.parse_gpus("2xH100-SXM")
    return Context(costs, cluster, Settings.of(engine=engine, global_batch=8, mem_target=1.0, fp8=fp8), get_engine(engine))


@pytest.mark.parametrize("engine", ["deepspeed", "torch"])
def test_other_engines_keep_the_traced_activations(tiny, engine):
    """The engines that run the user's module price the traced bytes: the hook returns the costs it is given."""
    ctx = _ctx(tiny, engine)
    sharded = ctx.sharded(1, 1)
    assert get_engine(engine).layer_activations(sharded, 1, False, 1, "none") is sharded
    for a, b in zip(ctx.memory(1, 1, "none"), range_matrices(sharded, 1, "none")):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_megatron_plans_of_the_llama_example_use_its_own_layer(tiny, fp8, recompute):
    """llama-tiny (4 layers, h 64, 4 heads of 16 in 2 groups, SwiGLU 176, RMSNorm, s 32) under Megatron: each block keeps
    the TE layer's bytes, written out here: norm inputs and outputs 4 x 2 sh, q 2 sh, k and v 2 x 2 x sh/2, attention
    output 2 sh, FC1's output 2 x 2 s f, FC2's input 2 s f, fp32 1/sigma 2 x 4 s and softmax statistics 4 x 4 s; the
    embedding and the head as traced; full recompute keeps each layer's input."""
    s, h, f, L = 32, 64, 176, 4
    other = 2 * 2 * s * h + 2 * s * h + 2 * 2 * s * h / 2 + 2 * 2 * s * f + 2 * 4 * s
    gemm = 2 * 2 * s * h + 2 * s * f
    out = 2 * s * h
    lse = 4 * 4 * s
    if recompute == "selective":
        layer = other + (gemm + out) * (0.5 if fp8 else 1)
    else:
        layer = other + lse + gemm * (0.5 if fp8 else 1) + out * (1.5 if fp8 else 1)
    ctx = _ctx(tiny, "megatron", fp8)
    blocks = [k for k, l in enumerate(tiny.layers) if l.block is not None]
    a, z = blocks[0], blocks[-1] + 1
    _, other_m, act, _ = ctx.memory(1, 1, recompute, fp8=fp8)
    if recompute == "full":
        assert act[a, z] == pytest.approx(sum(tiny.cuts[k].bytes for k in range(a, z) if k == a or tiny.layers[k].block != tiny.layers[k - 1].block))
        assert act[a, z] == pytest.approx(L * 2 * s * h)  # each layer's bf16 input
        ws = max(l.max_op_bytes for l in tiny.layers[a:z])
        buffers = 2.0 * (tiny.cuts[a].bytes + tiny.cuts[z].bytes) + sum(l.buffer_bytes for l in tiny.layers[a:z])
        assert other_m[a, z] - buffers == pytest.approx(ws + layer)  # the working set: one rebuilt layer
    else:
        assert act[a, z] == pytest.approx(L * layer)
        assert act[0, a] == pytest.approx(range_matrices(tiny, 1, recompute, fp8)[2][0, a])  # the embedding as traced


def test_megatron_hook_leaves_models_it_does_not_build_as_traced(tiny):
    """Experts or multi-latent attention (keys beyond the dense layer's), or blocks not matching num_layers: traced."""
    moe = replace(tiny, architecture={**tiny.architecture, "num_experts": 8})
    assert megatron_layer_activations(moe, 1, False, 1, "none") is moe
    short = replace(tiny, architecture={**tiny.architecture, "num_layers": 3})
    assert megatron_layer_activations(short, 1, False, 1, "none") is short


def test_priced_megatron_layout_reports_its_layer_bytes(tiny):
    """evaluate_layout's activations per micro-batch are the closed form's (no recompute, bf16)."""
    ctx = _ctx(tiny, "megatron")
    ev = evaluate_layout(ctx, Layout("megatron", 1, 1, 2, 1, 1, 4, 8, "1f1b", "none", 1), "bf16")
    s, h, f = 32, 64, 176
    layer = 4 * 2 * s * h + 2 * s * h + 2 * s * h + 2 * s * h + 6 * s * f + 2 * 4 * s + 4 * 4 * s
    blocks = [k for k, l in enumerate(tiny.layers) if l.block is not None]
    head = tiny.n - 1
    traced_rest = sum(l.saved_bytes for k, l in enumerate(tiny.layers) if k not in blocks and k != head)
    V = tiny.architecture["vocab_size"]
    loss = tiny.cuts[head].bytes + s * V * 4 + s * 9  # megatron-core's loss: the output layer's input, fp32 softmax, mask and ids
    assert sum(ev.act_per_mb) == pytest.approx(4 * layer + traced_rest + loss)


def test_dropout_at_zero_keeps_no_mask():
    """Megatron's bias-dropout-add calls torch's dropout; at p = 0 it returns its input (no mask saved), which is why a
    Llama layer (dropout 0) has no mask terms."""
    import torch

    y = torch.randn(4, 4, requires_grad=True) * 1.0
    assert torch.nn.functional.dropout(y, p=0.0, training=True) is y
    gpt0 = layer_saved(LayerShape.from_architecture({**GPT3, "dropout": 0.0}), 2048, 1, 8, True)
    gpt1 = layer_saved(LayerShape.from_architecture(GPT3), 2048, 1, 8, True)
    assert kept_bytes(gpt1) - kept_bytes(gpt0) == pytest.approx(2 * 1 * 2048 * 12288 / 8)  # two 1-byte masks, s b h / t each


def test_keys_at_their_defaults_keep_the_megatron_layer(tiny):
    """architecture() keys beyond the dense layer's that are unset or at Megatron's default (qk_layernorm False,
    num_experts None, as hf: configs derive them) still describe the dense layer; set off default they do not."""
    from planner.engines.megatron.rules import dense_layer

    dense = {**tiny.architecture, "qk_layernorm": False, "num_experts": None, "multi_latent_attention": False}
    assert dense_layer(dense)
    costs = replace(tiny, architecture=dense)
    assert megatron_layer_activations(costs, 1, False, 1, "none") is not costs  # the blocks' bytes were replaced
    assert not dense_layer({**dense, "qk_layernorm": True})
    assert not dense_layer({**dense, "multi_latent_attention": True})
    assert not dense_layer({**dense, "unknown_key": 3})


def test_squared_relu_layer_keeps_the_relu_output_and_fc2_input():
    """Megatron's squared_relu, torch.pow(F.relu(x), 2): ReLU keeps its output and the square its input, one storage, and
    FC1's output is freed; FC2 keeps the square's output. The same 2 F as GeLU's MLP, F wide (ungated)."""
    import torch
    from megatron.core.activations import squared_relu

    kept = []
    x = torch.randn(8, 2, 96, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = squared_relu(x * 1.0)  # x * 1.0: FC1's output, no longer referenced afterwards
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    assert len(storages) == 1 and out.untyped_storage().data_ptr() not in storages and x.untyped_storage().data_ptr() not in storages
    arch = {**LLAMA70, "activation": "squared_relu", "ffn_hidden_size": 4 * 8192}
    s, b, t = 4096, 1, 8
    relu = _named(layer_saved(LayerShape.from_architecture(arch), s, b, t, True))
    gelu = _named(layer_saved(LayerShape.from_architecture({**arch, "activation": "gelu"}), s, b, t, True))
    f = s * b * 4 * 8192 / t
    assert relu["ReLU output (the square's input)"] == 2 * f == sum(storages.values()) * f / x.numel()
    assert relu["activation output (FC2 input)"] == 2 * f
    assert sum(relu.values()) == sum(gelu.values())


def test_megatron_plans_the_squared_relu_llama_example():
    """examples/llama.py activation=squared_relu (Nemotron-4's MLP) traces without FC3, renders --squared-relu and
    megatron-core builds its layer with that function."""
    from megatron.core.activations import squared_relu

    from planner.engines.megatron.architecture import check_megatron_args
    from planner.engines.megatron.core_check import core_config
    from planner.engines.megatron.render import render as render_megatron
    from planner.engines.megatron.script import parse_megatron_args
    from planner.planning import plan_model
    from planner.solve.settings import Settings
    from tests.conftest import EXAMPLES, costs_of

    gated, plain = costs_of("llama", "llama-tiny"), costs_of("llama", "llama-tiny", activation="squared_relu")
    assert plain.architecture["activation"] == "squared_relu"
    h, f, L = 64, 176, 4
    assert gated.total_params - plain.total_params == L * h * f  # FC3 gone
    plan, _, _ = plan_model(
        Settings.of(
            model_file=str(EXAMPLES / "llama.py"), model_args={"preset": "llama-tiny", "activation": "squared_relu"}, gpus="4xH100-SXM", engine="megatron", pp=2
        )
    )
    args = parse_megatron_args(render_megatron(plan, "c", None)["pretrain_gpt.sh"])
    assert args.has("--squared-relu") and not args.has("--swiglu") and check_megatron_args(args) == []
    assert core_config(args).activation_func is squared_relu


def test_an_explicitly_traced_gpt_keeps_the_unfused_softmax_under_megatron():
    """examples/gpt2.py with attention=explicit (the s x s scores, softmax and dropout traced) under Megatron: each block
    keeps Korthikanti's s b h (34 + 5 a s / h) bytes plus the two LayerNorms' fp32 statistics (16 s b), as Megatron's
    unfused attention (TE's UnfusedDotProductAttention, the legacy CoreAttention) does; the same model traced with
    sdpa keeps the flash set, without the 5 a s^2 b."""
    from pathlib import Path

    from planner.model.analyze import analyze

    s, h, a, L, b = 64, 64, 4, 2, 2
    args = {"preset": "gpt2-tiny", "n_layer": L, "n_embd": h, "n_head": a, "seq_len": s, "vocab_size": 128}
    path = Path(__file__).resolve().parents[2] / "examples" / "gpt2.py"
    per_layer = {}
    for attention in ("explicit", "sdpa"):
        costs = analyze(path, {**args, "attention": attention}, 1, "bf16").costs
        mine = megatron_layer_activations(costs.scaled(b), 1, False, 1, "none")
        blocks = [l for l in mine.layers if l.block is not None]
        per_layer[attention] = sum(l.saved_bytes for l in blocks) / L
    korthikanti = s * b * h * (34 + 5 * a * s / h) + 16 * s * b
    assert per_layer["explicit"] == pytest.approx(korthikanti, rel=1e-6)
    # flash: no s x s tensors, the fp32 softmax statistics (a s b) in their place, and the attention output shared with
    # the projection (kept once): 34 s b h less the dropout's two s x s copies' place
    assert per_layer["explicit"] - per_layer["sdpa"] == pytest.approx(5 * a * s * s * b - 4 * a * s * b, rel=1e-6)
