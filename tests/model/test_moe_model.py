"""examples/moe.py: published model sizes, FLOPs the planner counts against closed forms, routing against a per-token loop."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from planner.cli import app

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "moe.py"
runner = CliRunner()

_spec = importlib.util.spec_from_file_location("moe_example", MODEL)
moe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(moe)


def _meta_params(preset: str) -> tuple[int, int]:
    """(total, active) counted on the built model: active drops (E - k) / E of every Experts module's weights."""
    with torch.device("meta"):
        m = moe.build_model(preset)
    total = sum(p.numel() for p in m.parameters())
    idle = 0
    for mod in m.modules():
        if isinstance(mod, moe.Experts):
            n, E = sum(p.numel() for p in mod.parameters()), mod.w1.shape[0]
            idle += n * (E - m.layers[-1].feed_forward.top_k) // E
    return total, total - idle


# (total, active) parameters as published, the unit of the last digit published, and how the source shortens:
# Mistral rounds (12.88B -> 12.9B), DeepSeek and Qwen truncate (37.55B -> 37B, 3.35B -> 3.3B)
PUBLISHED = {
    "mixtral-8x7b": (46.7e9, 12.9e9, 0.1e9, "round"),  # Mixtral of Experts (arXiv 2401.04088): 46.7B, 12.9B active
    "mixtral-8x22b": (141e9, 39e9, 1e9, "round"),  # Mistral AI, Mixtral 8x22B release: 141B, 39B active
    "deepseek-v3": (671e9, 37e9, 1e9, "truncate"),  # DeepSeek-V3 report (arXiv 2412.19437): 671B, 37B activated (MTP excluded)
    "qwen3-30b-a3b": (30.5e9, 3.3e9, 0.1e9, "truncate"),  # Qwen3 report (arXiv 2505.09388) Table 2: 30.5B, 3.3B activated
    "qwen3-235b-a22b": (235e9, 22e9, 1e9, "truncate"),  # the same table: 235B, 22B activated
}


def _shortened(x: int, digit: float, how: str) -> float:
    return (round(x / digit) if how == "round" else x // digit) * digit


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_parameter_counts_are_the_published_sizes(preset):
    total, active, digit, how = PUBLISHED[preset]
    built_total, built_active = _meta_params(preset)
    assert (built_total, built_active) == moe.parameter_counts(preset)
    assert _shortened(built_total, digit, how) == pytest.approx(total) and _shortened(built_active, digit, how) == pytest.approx(active)


def test_layer_pattern_first_dense_then_every_nth():
    assert [moe.is_moe_layer(i, 3, 1) for i in range(5)] == [False, False, False, True, True]
    assert [moe.is_moe_layer(i, 1, 2) for i in range(6)] == [False, True, False, True, False, True]
    with torch.device("meta"):
        m = moe.build_model("deepseek-tiny", moe_layer_freq=2, n_layers=5)
    kinds = [type(layer.feed_forward).__name__ for layer in m.layers]
    assert kinds == ["FeedForward", "MoE", "FeedForward", "MoE", "FeedForward"]
    assert sum(p.numel() for p in m.parameters()) == moe.parameter_counts("deepseek-tiny", moe_layer_freq=2, n_layers=5)[0]


def _inspect(*args: str) -> dict:
    r = runner.invoke(app, ["inspect", str(MODEL), *[a for kv in args for a in ("--model-arg", kv)], "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["totals"]


@pytest.mark.parametrize("preset", ["moe-tiny", "deepseek-tiny", "mixtral-8x7b"])
def test_planner_counts_the_closed_form_forward_flops(preset):
    """The planner's per-operator count of the traced model (grouped GEMMs included) equals the closed form."""
    t = _inspect(f"preset={preset}")
    assert t["flops_fwd"] == moe.forward_flops_per_token(preset) * t["seq_len"]
    assert t["params"] == moe.parameter_counts(preset)[0]


def test_routed_experts_cost_top_k_not_all():
    """Raising top_k from 2 to 4 of 4 experts adds exactly 2 more experts' GEMMs per token in each MoE layer."""
    cfg = moe._config("moe-tiny")
    k2, k4 = _inspect("preset=moe-tiny")["flops_fwd"], _inspect("preset=moe-tiny", "top_k=4")["flops_fwd"]
    per_expert_token = 2 * 3 * cfg["dim"] * cfg["moe_ffn_dim"]
    assert k4 - k2 == cfg["n_layers"] * 2 * per_expert_token * cfg["seq_len"]


def megatron_flops_per_token(preset: str) -> float:
    """Megatron-LM's num_floating_point_operations (core 0.9-0.12, GQA + MoE + shared experts) / tokens:
    12 L h^2 ((1 + g/a + s/h) q/h + ffn/h x k x 3/2 + shared/h x 3/2 + V/(2 L h)), all layers MoE."""
    c = moe._config(preset)
    L, h, s, q = c["n_layers"], c["dim"], c["seq_len"], c["n_heads"] * c["head_dim"]
    attention = (1 + c["n_kv_heads"] / c["n_heads"] + s / h) * q / h
    mlp = c["moe_ffn_dim"] / h * c["top_k"] * 1.5 + c["n_shared_experts"] * c["shared_ffn_dim"] / h * 1.5
    return 12 * L * h * h * (attention + mlp + c["vocab_size"] / (2 * L * h))


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "moe-tiny"])
def test_three_forwards_are_megatrons_count_plus_the_router(preset):
    """Megatron counts 3 passes of every GEMM except the router's (d x E per token and layer, small)."""
    c = moe._config(preset)
    router = 2 * c["dim"] * c["num_experts"] * c["n_layers"]
    assert 3 * (moe.forward_flops_per_token(preset) - router) == pytest.approx(megatron_flops_per_token(preset), rel=1e-12)


def _naive_moe(layer: "moe.MoE", x: torch.Tensor) -> torch.Tensor:
    """The MoE layer token by token: sum over its k experts of weight x SwiGLU expert, plus the shared experts."""
    tokens = x.reshape(-1, x.shape[-1])
    ids, weights = layer.router(tokens)
    e = layer.experts
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(ids.shape[1]):
            i = int(ids[t, j])
            h = torch.nn.functional.silu(tokens[t] @ e.w1[i]) * (tokens[t] @ e.w3[i])
            out[t] += weights[t, j] * (h @ e.w2[i])
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(tokens)
    return out.view(x.shape)


@pytest.mark.parametrize("preset", ["moe-tiny", "deepseek-tiny"])
def test_grouped_gemm_routing_equals_a_per_token_loop(preset):
    torch.manual_seed(0)
    m = moe.build_model(preset)
    layer = next(layer.feed_forward for layer in m.layers if isinstance(layer.feed_forward, moe.MoE))
    if preset == "deepseek-tiny":
        layer.router.expert_bias.copy_(torch.randn(layer.num_experts))  # the bias steers the choice, not the weights
    x = torch.randn(2, 16, 64)
    y = layer(x)
    assert torch.allclose(y, _naive_moe(layer, x), atol=1e-5, rtol=1e-5)
    ids, weights = layer.router(x.reshape(-1, 64))
    scale = moe._config(preset)["routed_scale"]
    assert torch.allclose(weights.sum(-1), torch.full((32,), scale))  # normalised top-k weights
    assert ids.shape == (32, layer.top_k) and len(set(map(tuple, ids.sort(-1).values.tolist()))) > 1


def test_backward_through_the_grouped_gemm_matches_the_loop():
    torch.manual_seed(1)
    m = moe.build_model("moe-tiny")
    layer = m.layers[0].feed_forward
    x = torch.randn(1, 8, 64)
    g = torch.randn(1, 8, 64)
    (layer(x) * g).sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    (_naive_moe(layer, x) * g).sum().backward()
    for a, b in zip(grads, [p.grad for p in layer.parameters()]):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_export_traces_static_shapes_and_generalises_to_other_routings():
    """torch.export traces the layer once; the program equals eager on inputs that route differently.

    In bf16: torch's fake (meta) kernel of the grouped GEMM accepts only bf16, as its CUDA kernel does."""
    torch.manual_seed(2)
    layer = moe.build_model("deepseek-tiny").layers[1].feed_forward.to(torch.bfloat16)
    ep = torch.export.export(layer, (torch.randn(2, 16, 64, dtype=torch.bfloat16),), strict=False)
    assert sum(n.target is torch.ops.aten._grouped_mm.default for n in ep.graph.nodes) == 3
    routes = set()
    for seed in (3, 4):
        torch.manual_seed(seed)
        x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
        assert torch.equal(ep.module()(x), layer(x))
        routes.add(tuple(layer.router(x.reshape(-1, 64))[0].flatten().tolist()))
    assert len(routes) == 2


@pytest.mark.parametrize(
    "arg, words",
    [("top_k=9", "top_k must be between 1 and num_experts"), ("router=relu", "router must be one of"), ("experts=4", "unknown model argument")],
)
def test_bad_model_arguments_are_usage_errors(arg, words):
    r = runner.invoke(app, ["inspect", str(MODEL), "--model-arg", "preset=moe-tiny", "--model-arg", arg])
    assert r.exit_code == 2 and words in r.output


@pytest.mark.parametrize("preset", list(moe.PRESETS))
def test_architecture_maps_onto_megatron(preset):
    """Every preset's architecture() passes the planner's Megatron architecture rules (MoE rules included where the
    planner has them); the keys it adds for Megatron are the table's names."""
    from planner.engines.megatron import architecture as megatron_args

    assert megatron_args.architecture_problem(moe.architecture(preset)) is None
    if hasattr(megatron_args, "moe_architecture_problems"):
        assert megatron_args.moe_architecture_problems(moe.architecture(preset)) == []
        table = {k.name for k in megatron_args.ARCHITECTURE}
        extra = set(moe.architecture(preset)) - table - {"block_path"}
        assert extra <= {"kv_channels", "qk_layernorm"}, extra


@pytest.mark.parametrize("preset", ["moe-tiny", "deepseek-tiny", "qwen3-30b-a3b", "mixtral-8x7b"])
def test_qk_layernorm_says_whether_attention_has_its_own_norms(preset):
    """Megatron builds the attention's own norms (Qwen3's per-head q/k norms, MLA's latent q/kv norms) only under
    --qk-layernorm: architecture() says so exactly when the model file has them."""
    import torch

    with torch.device("meta"):
        model = moe.build_model(preset=preset, n_layers=2)
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, moe.RMSNorm)}
    assert moe.architecture(preset, n_layers=2)["qk_layernorm"] == bool(names & {"q_norm", "k_norm", "kv_norm"})


def test_architecture_carries_the_moe_shape():
    a = moe.architecture("deepseek-v3")
    assert a["num_experts"] == 256 and a["moe_router_topk"] == 8 and a["moe_ffn_hidden_size"] == 2048
    assert a["moe_layer_freq"] == [0, 0, 0] + [1] * 58 and a["moe_shared_expert_intermediate_size"] == 2048
    assert a["moe_router_score_function"] == "sigmoid" and a["moe_router_enable_expert_bias"] and a["moe_router_topk_scaling_factor"] == 2.5
    assert a["multi_latent_attention"] and (a["q_lora_rank"], a["kv_lora_rank"], a["qk_head_dim"], a["qk_pos_emb_head_dim"], a["v_head_dim"]) == (
        1536,
        512,
        128,
        64,
        128,
    )
    q = moe.architecture("qwen3-30b-a3b")
    assert q["kv_channels"] == 128 != q["hidden_size"] // q["num_attention_heads"] and q["qk_layernorm"]


@pytest.mark.parametrize("preset", ["deepseek-v3", "qwen3-30b-a3b"])
def test_the_planner_finds_the_routed_experts(preset):
    """Where the planner recognises routed experts by structure, every MoE layer's experts are found with E and k."""
    experts = pytest.importorskip("planner.model.experts")
    with torch.device("meta"):
        m = moe.build_model(preset)
    c = moe._config(preset)
    groups = experts.find_experts(m)
    n_moe = sum(moe.is_moe_layer(i, c["first_k_dense"], c["moe_layer_freq"]) for i in range(c["n_layers"]))
    assert len(groups) == n_moe and {(g.num_experts, g.top_k) for g in groups} == {(c["num_experts"], c["top_k"])}
    assert all(g.path.endswith("feed_forward.experts") for g in groups)


def test_mixed_precision_over_fp32_weights_runs_the_grouped_gemm():
    """The torch engine trains under autocast with fp32 master weights: autocast does not cover _grouped_mm, so the
    experts cast their weights to the routed rows' dtype; the bf16 result is the fp32 one within bf16 precision."""
    torch.manual_seed(5)
    m = moe.build_model("moe-tiny")
    x, target = moe.example_inputs(2, "moe-tiny")[0], moe.example_target(2, "moe-tiny")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x)
    assert out.dtype == torch.bfloat16
    moe.loss_fn(out, target).backward()
    w1 = m.layers[0].feed_forward.experts.w1
    assert w1.dtype == torch.float32 and w1.grad is not None and w1.grad.abs().sum() > 0
    ref = m(x)
    assert (out.float() - ref).norm() / ref.norm() < 0.02  # bf16 rounding through 4 layers (relative L2)
