"""The activations Megatron's MoE, multi-latent-attention and q/k-norm layers save (planner.engines.megatron.moe_activations):
each term against a closed form written out by hand here, the MoE sub-layer against the bytes real PyTorch saves when
it runs Megatron-Core's unfused router / permutation / grouped-MLP code paths (core_v0.16.1, copied below), and the
engine hook pricing the examples/moe.py blocks with them."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from planner import hardware
from planner.engines import get_engine
from planner.engines.megatron.activations import LayerShape, kept_bytes, layer_saved
from planner.engines.megatron.moe_activations import (
    MLAShape,
    MoEShape,
    experts_saved,
    megatron_layer_saved,
    mla_attention_saved,
    moe_mlp_saved,
    qk_norm_saved,
    router_saved,
)
from planner.engines.megatron.rules import megatron_layer, megatron_layer_activations, megatron_loss_working_set
from planner.solve.memory import range_matrices
from planner.solve.search import Context, expert_saved_extra
from planner.solve.settings import Settings


def _te_norm(inp, weight):
    """TENorm (RMSNorm) as an autograd Function that saves what TE's saves: its input and the fp32 1/sigma."""
    import torch

    class _TENorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            rs = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
            ctx.save_for_backward(x, rs)
            return (x.float() * rs).to(x.dtype) * w

        @staticmethod
        def backward(ctx, g):  # pragma: no cover - forward only
            raise NotImplementedError

    return _TENorm.apply(inp, weight)


MIXTRAL = {
    "num_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_query_groups": 8,
    "kv_channels": 128,
    "ffn_hidden_size": 14336,
    "normalization": "RMSNorm",
    "activation": "swiglu",
    "dropout": 0.0,
    "num_experts": 8,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 14336,
    "moe_router_score_function": "softmax",
    "moe_router_load_balancing_type": "none",
}
QWEN3_30B = {
    **MIXTRAL,
    "num_layers": 48,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_query_groups": 4,
    "kv_channels": 128,
    "ffn_hidden_size": 6144,
    "qk_layernorm": True,
    "num_experts": 128,
    "moe_router_topk": 8,
    "moe_ffn_hidden_size": 768,
}
DEEPSEEK_V3 = {
    "num_layers": 61,
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "ffn_hidden_size": 18432,
    "normalization": "RMSNorm",
    "activation": "swiglu",
    "dropout": 0.0,
    "multi_latent_attention": True,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128,
    "num_experts": 256,
    "moe_router_topk": 8,
    "moe_ffn_hidden_size": 2048,
    "moe_shared_expert_intermediate_size": 2048,
    "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "moe_router_topk_scaling_factor": 2.5,
    "moe_router_load_balancing_type": "none",
}
MiB = 2**20


def _named(terms):
    return {t.name: t.bytes for t in terms}


def test_mixtral_moe_sublayer_by_hand():
    """Mixtral 8x7B, s 4096, b 1, tp 1, etp 1 (the MLM-mixtral-8x7b row), bf16: T = 4096 tokens, N = T x 2 = 8192
    rows. Norm input and output 2 x 32 MiB, fp32 1/sigma 16 KiB; router: top-k indices 8 x T x 2 and fp32 top-k softmax
    4 x T x 2; permutation: the transposed probabilities 2 x T x 8 (masked_select's input), bool map T x 8 and int64
    indices 8 x T x 2; experts: FC1 input 2 x N x 4096 = 64 MiB, FC1
    output 2 x N x 2 x 14336 = 448 MiB, probabilities 2 x N, FC2 input 2 x N x 14336 = 224 MiB."""
    T, N = 4096, 8192
    terms = moe_mlp_saved(LayerShape.from_architecture(MIXTRAL), MoEShape.from_architecture(MIXTRAL), 4096, 1)
    n = _named(terms)
    assert n["mlp norm input"] == n["mlp norm output (router and shared-expert input)"] == 32 * MiB
    assert n["mlp norm statistics"] == 4 * T
    assert n["router top-k indices"] == 8 * T * 2 and n["router softmax output (fp32, top-k)"] == 4 * T * 2
    assert n["routing map (permute's mask)"] == T * 8 and n["permutation indices"] == 8 * T * 2
    assert n["routing probabilities, transposed (masked_select's input)"] == 2 * T * 8
    assert n["expert FC1 input rows"] == 64 * MiB
    assert n["expert FC1 output (activation input)"] == 448 * MiB
    assert n["permuted probabilities (weighted activation)"] == 2 * N
    assert n["expert activation output (FC2 input)"] == 224 * MiB
    total = (32 + 32 + 64 + 448 + 224) * MiB + 4 * T + 8 * T * 2 + 4 * T * 2 + 2 * T * 8 + T * 8 + 8 * T * 2 + 2 * N
    assert kept_bytes(terms) == pytest.approx(total)
    # FP8: the expert GEMM inputs (FC1's rows and FC2's input) in 1 byte; the router keeps the bf16 norm output
    assert kept_bytes(terms, fp8=True) == pytest.approx(total - (64 + 224) / 2 * MiB)
    assert not any("shared" in t.name and "router" not in t.name for t in terms)


@pytest.mark.parametrize("etp", [1, 2])
def test_qwen3_moe_sublayer_tp2_sp(etp):
    """Qwen3-30B-A3B with tp 2 and sequence parallelism (s 4096, b 1): the residual stream is split, T = 2048 tokens per
    GPU; 128 experts, top-8: the routed rows are T x 8 x etp, each expert's width 768 / etp, so the expert FC1 output and
    FC2 input per GPU do not depend on etp and the FC1 input rows grow with it (the expert-TP all-gather)."""
    T, h, k, E, f = 2048, 2048, 8, 128, 768
    terms = moe_mlp_saved(LayerShape.from_architecture(QWEN3_30B), MoEShape.from_architecture(QWEN3_30B), 4096, 1, tp=2, sequence_parallel=True, etp=etp)
    n = _named(terms)
    N = T * k * etp
    assert n["mlp norm input"] == 2 * T * h
    assert n["routing map (permute's mask)"] == T * E
    assert n["expert FC1 input rows"] == 2 * N * h
    assert n["expert FC1 output (activation input)"] == 2 * T * k * 2 * f
    assert n["expert activation output (FC2 input)"] == 2 * T * k * f
    assert n["permuted probabilities (weighted activation)"] == 2 * N


def test_deepseek_router_and_shared_experts_by_hand():
    """DeepSeek-V3's sigmoid router with expert bias and top-8 (T = 4096, E = 256): fp32 sigmoid over all experts
    4 x T x 256 and its bf16 cast 2 x T x 256 (gather's input), the gathered scores and their sum 2 x T x 9 (bf16), the
    int64 indices; one shared expert of width 2048
    (tp 1): FC1's output 2 x T x 4096 and FC2's input 2 x T x 2048; the norm output is then a GEMM's input too
    (``shared``: FP8 adds a 1-byte copy)."""
    T, E, k = 4096, 256, 8
    moe = MoEShape.from_architecture(DEEPSEEK_V3)
    assert moe.score == "sigmoid" and moe.shared_ffn == 2048 and not moe.aux_loss
    n = _named(router_saved(moe, T))
    assert n["router sigmoid output (fp32)"] == 4 * T * E
    assert n["router scores in the input dtype (gather's input)"] == 2 * T * E
    assert n["router top-k scores and their sum (normalisation)"] == 2 * T * (k + 1)
    assert n["router top-k indices"] == 8 * T * k
    terms = moe_mlp_saved(LayerShape.from_architecture(DEEPSEEK_V3), moe, 4096, 1)
    m = _named(terms)
    assert m["shared-expert FC1 output (activation input)"] == 2 * T * 2 * 2048
    assert m["shared-expert activation output (FC2 input)"] == 2 * T * 2048
    shared = next(t for t in terms if t.name.startswith("mlp norm output"))
    assert shared.kind == "shared" and shared.bytes == 2 * T * 7168
    # FP8: expert FC1 rows (2 x T x 8 x 7168), expert FC2 input (2 x T x 8 x 2048), shared FC2 input halve; +1 B copy
    saved = 2 * T * 8 * 7168 + 2 * T * 8 * 2048 + 2 * T * 2048
    assert kept_bytes(terms) - kept_bytes(terms, fp8=True) == pytest.approx(saved / 2 - T * 7168)


def test_router_variants_and_balancing_loss():
    """Pre-softmax keeps the fp32 softmax over all experts; a balancing loss (aux_loss with a coefficient) the fp32
    scores over all experts once more; group-limited routing a bool mask (its group top-ks are freed); top-1 sigmoid
    keeps no normalisation."""
    T, E, k = 100, 16, 4
    base = MoEShape.from_architecture({**MIXTRAL, "num_experts": E, "moe_router_topk": k})
    pre = replace(base, pre_softmax=True)
    assert _named(router_saved(pre, T))["router softmax output (fp32, all experts)"] == 4 * T * E
    aux = replace(base, aux_loss=True)
    assert kept_bytes(router_saved(aux, T)) - kept_bytes(router_saved(base, T)) == 4 * T * E
    grouped = replace(base, groups=4, group_topk=2)
    assert kept_bytes(router_saved(grouped, T)) - kept_bytes(router_saved(base, T)) == T * E
    top1 = replace(base, score="sigmoid", topk=1)
    assert "router top-k scores and their sum (normalisation)" not in _named(router_saved(top1, T))
    assert MoEShape.from_architecture({**MIXTRAL, "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.01}).aux_loss
    assert not MoEShape.from_architecture({**MIXTRAL, "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0}).aux_loss
    with pytest.raises(ValueError):
        MoEShape.from_architecture({**MIXTRAL, "moe_router_load_balancing_type": "sinkhorn"})


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True)])
def test_deepseek_mla_attention_by_hand(tp, sp):
    """DeepSeek-V3 MLA (128 heads, q rank 1536, kv rank 512, q/k heads 128 + 64 rope, v 128), s 4096, b 1: norm input
    and output 2 x 2 x T x 7168 (T = 4096 / tp with sequence parallelism), 1/sigma 4 T; up-projection inputs
    2 T (1536 + 512); RoPE cos/sin 4 x 2 x s x 64; q and k 2 x 2 x s x 128/tp x 192, v and the output
    2 x 2 x s x 128/tp x 128; softmax statistics 4 x s x 128/tp."""
    s = 4096
    T = s // (tp if sp else 1)
    H = 128 // tp
    terms = mla_attention_saved(LayerShape.from_architecture(DEEPSEEK_V3), MLAShape.from_architecture(DEEPSEEK_V3), s, 1, tp, sp)
    expected = 2 * 2 * T * 7168 + 4 * T + 2 * T * (1536 + 512) + 4 * 2 * s * 64 + 2 * 2 * s * H * 192 + 2 * 2 * s * H * 128 + 4 * s * H
    assert kept_bytes(terms) == pytest.approx(expected)
    n = _named(terms)
    assert n["softmax statistics"] == 4 * s * H
    # selective recomputation drops the statistics; FP8 halves the up-projection inputs and copies the output
    assert kept_bytes(terms, "selective") == pytest.approx(expected - 4 * s * H)
    assert kept_bytes(terms, fp8=True) == pytest.approx(expected - T * (1536 + 512) + s * H * 128)
    # --qk-layernorm: the up projections are LayerNormLinear: each also keeps its input and 1/sigma
    normed = mla_attention_saved(LayerShape.from_architecture(DEEPSEEK_V3), MLAShape.from_architecture({**DEEPSEEK_V3, "qk_layernorm": True}), s, 1, tp, sp)
    assert kept_bytes(normed) - kept_bytes(terms) == pytest.approx(2 * T * (1536 + 512) + 2 * 4 * T)


def test_qwen3_qk_norm_by_hand():
    """Qwen3's per-head q/k RMSNorm (32 query heads, 4 groups, 128 wide; tp 2, s 4096): inputs 2 x s x 16 x 128 and
    2 x s x 2 x 128, fp32 1/sigma 4 x s x (16 + 2); it adds to the dense GQA attention sub-layer."""
    s, tp = 4096, 2
    n = _named(qk_norm_saved(LayerShape.from_architecture(QWEN3_30B), s, 1, tp))
    assert n["q norm input"] == 2 * s * 16 * 128 and n["k norm input"] == 2 * s * 2 * 128
    assert n["q/k norm statistics"] == 4 * s * 18
    layer = megatron_layer_saved(QWEN3_30B, False, s, 1, tp, True)
    dense = layer_saved(LayerShape.from_architecture(QWEN3_30B), s, 1, tp, True)
    extra = kept_bytes(tuple(t for t in layer if t.part == "attention")) - kept_bytes(tuple(t for t in dense if t.part == "attention"))
    assert extra == pytest.approx(sum(n.values()))


def test_dense_arch_is_the_dense_layer():
    """Without experts, MLA or q/k norms the composed layer is megatron_activations.layer_saved term for term."""
    arch = {k: v for k, v in MIXTRAL.items() if not k.startswith(("num_experts", "moe_"))}
    for tp, sp in ((1, False), (4, True)):
        assert megatron_layer_saved(arch, False, 2048, 2, tp, sp) == layer_saved(LayerShape.from_architecture(arch), 2048, 2, tp, sp)


# --------------------------------------------------------------------------- against real PyTorch


def _megatron_moe_forward(x, weights, cfg):
    """One MoE sub-layer as Megatron-Core core_v0.16.1 runs it with ep = etp = tp = 1, the alltoall dispatcher, grouped
    GEMMs and no fusions, written with the same torch calls (the all-to-alls are the identity at ep 1):
    TENorm (:func:`_te_norm`: TE saves the input and fp32 1/sigma), TopKRouter.gating (RouterGatingLinearFunction saves
    its input), moe_utils.topk_routing_with_score_function (unfused), permute / sort_chunks_by_idxs / unpermute
    (unfused), TEGroupedMLP with WeightedSwiGLUFunction (fused_bias_swiglu.py), GroupedLinear as torch._grouped_mm
    (which keeps its input rows, as TE's GroupedLinear does), SharedExpertMLP with SwiGLUFunction."""
    import torch

    class _RouterGating(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inp, w):
            ctx.save_for_backward(inp, w)
            return torch.mm(inp, w.t())

        @staticmethod
        def backward(ctx, g):  # pragma: no cover
            raise NotImplementedError

    class _WeightedSwiGLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inp, probs):
            ctx.save_for_backward(inp, probs)
            a, b = torch.chunk(inp, 2, -1)
            return (torch.nn.functional.silu(a) * b * probs).to(inp.dtype)

        @staticmethod
        def backward(ctx, g):  # pragma: no cover
            raise NotImplementedError

    class _SwiGLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inp):
            ctx.save_for_backward(inp)
            a, b = torch.chunk(inp, 2, -1)
            return torch.nn.functional.silu(a) * b

        @staticmethod
        def backward(ctx, g):  # pragma: no cover
            raise NotImplementedError

    E, k = cfg["experts"], cfg["topk"]
    h = _te_norm(x, weights["norm"])
    tokens = h.view(-1, h.shape[-1])
    num_tokens = tokens.shape[0]
    logits = _RouterGating.apply(tokens, weights["router"])

    def compute_topk(scores):
        if not cfg.get("groups"):
            return torch.topk(scores, k=k, dim=1)
        groups, group_topk = cfg["groups"], cfg["group_topk"]  # moe_utils.group_limited_topk
        group_scores = scores.view(num_tokens, groups, -1).topk(k // group_topk, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(num_tokens, groups, E // groups).reshape(num_tokens, -1)
        masked_scores = scores.masked_fill(~score_mask.bool(), float("-inf"))
        return torch.topk(masked_scores, k=k, dim=-1)

    if cfg["score"] == "softmax" and cfg.get("pre_softmax"):
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        probs, top_indices = compute_topk(scores)
    elif cfg["score"] == "softmax":
        scores, top_indices = compute_topk(logits)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
    else:
        scores = torch.sigmoid(logits.float()).type_as(logits)
        _, top_indices = torch.topk(scores + weights["expert_bias"], k=k, dim=1)
        scores = torch.gather(scores, dim=1, index=top_indices).type_as(logits)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        probs = probs * 2.5
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
    if cfg.get("aux"):  # compute_routing_scores_for_aux_loss (softmax) and switch_load_balancing_loss_func's product
        aux_scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        _, aux_indices = torch.topk(aux_scores, k=k, dim=1)
        aux_map = torch.zeros_like(logits).int().scatter(1, aux_indices, 1).bool()
        aux_loss = torch.sum(aux_scores.sum(dim=0) * aux_map.sum(dim=0)) * 0.01
        routing_probs = routing_probs + 0 * aux_loss  # keeps the loss in the graph, as MoEAuxLossAutoScaler does
    # permute (dispatch_preprocess)
    rmap = routing_map.bool().T.contiguous()
    token_indices = torch.arange(num_tokens).unsqueeze(0).expand(E, -1)
    sorted_indices = token_indices.masked_select(rmap)
    permuted_probs = routing_probs.T.contiguous().masked_select(rmap)
    permuted = tokens.index_select(0, sorted_indices)
    # dispatch_postprocess at ep = 1: sort_chunks_by_idxs (split + cat)
    counts = rmap.sum(dim=1)
    permuted = torch.cat(list(torch.split(permuted, counts.tolist(), dim=0)), dim=0)
    permuted_probs = torch.cat(list(torch.split(permuted_probs, counts.tolist(), dim=0)), dim=0)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    fc1 = torch._grouped_mm(permuted, weights["fc1"], offs=offs)
    act = _WeightedSwiGLU.apply(fc1, permuted_probs.unsqueeze(-1))
    out = torch._grouped_mm(act, weights["fc2"], offs=offs)
    out = torch.cat(list(torch.split(out, counts.tolist(), dim=0)), dim=0)
    restored = torch.zeros((num_tokens, tokens.shape[1]), dtype=out.dtype).scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, tokens.shape[1]), out)
    if "shared_fc1" in weights:
        sh = _SwiGLU.apply(torch.nn.functional.linear(tokens, weights["shared_fc1"]))
        restored = restored + torch.nn.functional.linear(sh, weights["shared_fc2"])
    return restored.view(x.shape), offs


def _saved_bytes(fn, params):
    """Bytes autograd still holds for backward once ``fn`` has run (the graph of its result): one count per storage,
    parameters excluded. Tensors saved by nodes the result does not reach (a top-k whose values are dropped) are freed
    with them and not counted, as on the GPU."""
    import weakref

    import torch

    class Packed:
        def __init__(self, t):
            self.t = t

    live: weakref.WeakSet = weakref.WeakSet()
    skip = {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        box = Packed(t)
        live.add(box)
        return box

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
        result = fn()
    held = {box.t.untyped_storage().data_ptr(): box.t.untyped_storage().nbytes() for box in list(live)}
    return sum(n for ptr, n in held.items() if ptr not in skip), result


@pytest.mark.parametrize("score,shared,variant", [("softmax", False, ""), ("sigmoid", True, ""), ("softmax", False, "pre_softmax+groups+aux")])
def test_moe_sublayer_matches_what_torch_saves(score, shared, variant):
    """A tiny MoE sub-layer (s 24, b 2, h 32, 8 experts top-2 of width 48, bf16; sigmoid: DeepSeek's router with expert
    bias and a shared expert of width 40; or softmax over all experts, group-limited routing over 4 groups of which 2
    are chosen, and a balancing loss) run through Megatron's code paths on CPU: the bytes autograd saves equal
    moe_mlp_saved's, plus the int32 per-expert offsets of the grouped GEMM (the token counts the closed form leaves
    out) and, with the balancing loss, its int64 token count per expert. ep = 1, so the routed rows are exactly T x k
    whatever the routing."""
    import torch

    torch.manual_seed(0)
    s, b, h, E, k, f, fs = 24, 2, 32, 8, 2, 48, 40
    bf = torch.bfloat16
    weights = {
        "norm": torch.ones(h, dtype=bf, requires_grad=True),
        "router": torch.randn(E, h, dtype=bf, requires_grad=True),
        "expert_bias": torch.zeros(E),
        "fc1": torch.randn(E, h, 2 * f, dtype=bf, requires_grad=True),
        "fc2": torch.randn(E, f, h, dtype=bf, requires_grad=True),
    }
    arch = {
        "hidden_size": h,
        "num_attention_heads": 4,
        "normalization": "RMSNorm",
        "activation": "swiglu",
        "dropout": 0.0,
        "num_experts": E,
        "moe_router_topk": k,
        "moe_ffn_hidden_size": f,
        "moe_router_score_function": score,
        "moe_router_load_balancing_type": "none",
    }
    if shared:
        weights["shared_fc1"] = torch.randn(2 * fs, h, dtype=bf, requires_grad=True)
        weights["shared_fc2"] = torch.randn(h, fs, dtype=bf, requires_grad=True)
        arch["moe_shared_expert_intermediate_size"] = fs
    cfg = {"experts": E, "topk": k, "score": score}
    small = 0
    if variant:
        cfg.update(pre_softmax=True, groups=4, group_topk=2, aux=True)
        arch.update(
            moe_router_pre_softmax=True,
            moe_router_num_groups=4,
            moe_router_group_topk=2,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=0.01,
        )
        small = E * 8  # the balancing loss's token counts per expert (int64), kept by its product
    x = torch.randn(s, b, h, dtype=bf, requires_grad=True)
    params = [w for w in weights.values()]
    measured, (_, offs) = _saved_bytes(lambda: _megatron_moe_forward(x, weights, cfg), params)
    terms = moe_mlp_saved(LayerShape.from_architecture(arch), MoEShape.from_architecture(arch), s, b)
    assert measured == kept_bytes(terms) + offs.numel() * 4 + small
    # the routed rows are what the grouped GEMMs multiply: T x k
    assert int(offs[-1]) == s * b * k


def test_expert_rows_scale_with_topk_and_etp():
    """experts_saved is linear in the rows; the expert width splits over etp (rows x etp, width / etp)."""
    moe = MoEShape.from_architecture(MIXTRAL)
    one = kept_bytes(experts_saved(moe, 1000, 4096))
    assert kept_bytes(experts_saved(moe, 2000, 4096)) == pytest.approx(2 * one)
    two = _named(experts_saved(moe, 2000, 4096, etp=2))
    assert two["expert FC1 output (activation input)"] == _named(experts_saved(moe, 1000, 4096))["expert FC1 output (activation input)"]


# --------------------------------------------------------------------------- the engine hook


@pytest.fixture(scope="module")
def moe_tiny():
    from tests.conftest import costs_of

    return costs_of("moe", "moe-tiny")


@pytest.fixture(scope="module")
def deepseek_tiny():
    from tests.conftest import costs_of

    return costs_of("moe", "deepseek-tiny")


def _ctx(costs, engine="megatron", fp8=False, gpus="2xH100-SXM"):
    return Context(costs, hardware.parse_gpus(gpus), Settings.of(engine=engine, global_batch=8, mem_target=1.0, fp8=fp8), get_engine(engine))


def test_moe_tiny_blocks_under_megatron_by_hand(moe_tiny):
    """moe-tiny (4 MoE layers, h 64, 4 heads of 16 in 2 groups, 4 experts top-2 of width 64, RMSNorm, s 32, b 1) under
    Megatron, tp 1: attention as the dense TE layer (norm input and output 2 x 2 s h, q 2 s h, k and v 2 x 2 x s h / 2,
    output 2 s h, 1/sigma 4 s, softmax statistics 4 x 4 s); the MoE MLP: norm input and output 2 x 2 s h, 1/sigma 4 s,
    router indices 8 x s x 2 and softmax 4 x s x 2, transposed probabilities 2 x s x 4, map s x 4, permutation indices
    8 x s x 2; N = 2 s rows: FC1 input
    2 N h, FC1 output 2 N x 128, probabilities 2 N, FC2 input 2 N x 64."""
    s, h = 32, 64
    N = 2 * s
    attention = 2 * 2 * s * h + 2 * s * h + 2 * 2 * s * h / 2 + 2 * s * h + 4 * s + 4 * 4 * s
    mlp = 2 * 2 * s * h + 4 * s + 8 * s * 2 + 4 * s * 2 + 2 * s * 4 + s * 4 + 8 * s * 2 + 2 * N * h + 2 * N * 128 + 2 * N + 2 * N * 64
    ctx = _ctx(moe_tiny)
    blocks = [k for k, l in enumerate(moe_tiny.layers) if l.block is not None]
    a, z = blocks[0], blocks[-1] + 1
    act = ctx.memory(1, 1, "none")[2]
    assert act[a, z] == pytest.approx(4 * (attention + mlp))
    assert act[0, a] == pytest.approx(range_matrices(moe_tiny, 1, "none")[2][0, a])  # the embedding as traced
    costs = megatron_layer_activations(ctx.sharded(1, 1), 1, False, 1, "none")
    for k in blocks:
        assert costs.layers[k].saved_bytes == int(attention if moe_tiny.layers[k].kind == "attention" else mlp)


def test_etp_rows_are_counted_once(moe_tiny):
    """With etp 2 the closed form's FC1 input rows double (all-gathered over the expert-TP group); the traced path's
    expert_saved_extra is not added on top; the deepspeed engine (traced layers) still gets it."""
    s, h = 32, 64
    ctx = _ctx(moe_tiny, gpus="4xH100-SXM")
    blocks = [k for k, l in enumerate(moe_tiny.layers) if l.block is not None]
    a, z = blocks[0], blocks[-1] + 1
    one = ctx.memory(1, 2, "none", True, 1, False, 2, 1)[2][a, z]
    two = ctx.memory(1, 2, "none", True, 1, False, 1, 2)[2][a, z]
    T = s / 2  # sequence parallel over tp 2
    # per MoE layer: FC1 input rows 2 x (T k etp) x h grow by one T k h; probabilities 2 x T k more; FC1 output / FC2 input unchanged
    assert two - one == pytest.approx(4 * (2 * T * 2 * h + 2 * T * 2))
    traced = megatron_loss_working_set(megatron_layer_activations(ctx.sharded(1, 2), 2, True, 1, "none", 2), 2, 1)
    assert traced is not ctx.sharded(1, 2)
    sharded = ctx.sharded(1, 2)
    extra = expert_saved_extra(sharded, 2, 2, "none")[a, z]
    assert extra > 0
    # the extra is added only when the engine keeps the traced layers
    np.testing.assert_allclose(
        ctx.memory(1, 2, "none", True, 1, False, 1, 2)[2],
        range_matrices(traced, 2, "none", ep=1, etp=2)[2],
    )


def test_deepseek_tiny_dense_first_layer_and_mla(deepseek_tiny):
    """deepseek-tiny: layer 0 dense (MLA attention + the dense TE MLP of ffn 128), layers 1-3 MoE (sigmoid router, 8
    experts top-2 of width 32, one shared expert of 32); every block's bytes are megatron_layer_saved's."""
    ctx = _ctx(deepseek_tiny)
    arch = deepseek_tiny.architecture
    assert megatron_layer(arch)
    costs = megatron_layer_activations(ctx.sharded(1, 1), 1, False, 1, "none")
    assert costs is not ctx.sharded(1, 1)
    dense = megatron_layer_saved(arch, False, 32, 1)
    moe = megatron_layer_saved(arch, True, 32, 1)
    by_block: dict[str, float] = {}
    for l in costs.layers:
        if l.block is not None:
            by_block[l.block] = by_block.get(l.block, 0) + l.saved_bytes
    assert by_block["layers.0"] == pytest.approx(kept_bytes(dense), abs=2)
    for name in ("layers.1", "layers.2", "layers.3"):
        assert by_block[name] == pytest.approx(kept_bytes(moe), abs=2)
    # a pattern that does not match the traced MoE blocks leaves the costs as traced
    wrong = replace(ctx.sharded(1, 1), architecture={**arch, "moe_layer_freq": [1, 1, 1, 1]})
    assert megatron_layer_activations(wrong, 1, False, 1, "none") is wrong
    sinkhorn = replace(ctx.sharded(1, 1), architecture={**arch, "moe_router_load_balancing_type": "sinkhorn"})
    assert megatron_layer_activations(sinkhorn, 1, False, 1, "none") is sinkhorn


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_deepseek_tiny_memory_matrix_keeps_the_kinds(deepseek_tiny, fp8, recompute):
    """The search's activation matrix over the four blocks is the layers' kept bytes under the mode: FP8 takes the
    ``gemm`` terms to 1 byte and adds a 1-byte copy of the ``shared`` ones (the MoE norm output the shared expert's FC1
    reads, the attention output), selective drops the ``core`` ones (the softmax statistics)."""
    ctx = _ctx(deepseek_tiny, fp8=fp8)
    arch = deepseek_tiny.architecture
    blocks = [k for k, l in enumerate(deepseek_tiny.layers) if l.block is not None]
    a, z = blocks[0], blocks[-1] + 1
    act = ctx.memory(1, 1, recompute, fp8=fp8)[2]
    layers = [megatron_layer_saved(arch, moe, 32, 1, recompute=recompute) for moe in (False, True, True, True)]
    assert act[a, z] == pytest.approx(sum(kept_bytes(t, recompute, fp8) for t in layers), abs=16)
    shared = [t for t in layers[1] if t.kind == "shared"]
    assert {t.name for t in shared} == {"mlp norm output (router and shared-expert input)"} | (
        {"attention output (projection input)"} if recompute == "none" else set()
    )


def _megatron_mla_forward(x, w, cfg, checkpoint=None):
    """One MLA attention sub-layer as MLASelfAttention runs it at tp = cp = 1 with ``--rope-type rope
    --no-rope-fusion`` (multi_latent_attention.py ``get_query_key_value_tensors``, rope_utils.py
    ``_apply_rotary_pos_emb_bshd``, core_v0.16.1), written with the same torch calls; the TE modules as autograd
    Functions saving what TE saves: TENorm its input and fp32 1/sigma, TELinear its (contiguous) input, the fused
    attention kernel q, k, v, its output and fp32 softmax statistics. ``checkpoint`` (a megatron-core
    ``CheckpointWithoutOutput``): ``--recompute-modules mla_up_proj``, the up projections and RoPE run through it and
    their outputs discarded once the attention has run, as MLASelfAttention does."""
    import torch

    class _Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inp, weight):
            inp = inp.contiguous()  # TransformerEngineBaseModule.prepare_forward
            ctx.save_for_backward(inp, weight)
            return inp @ weight.t()

        @staticmethod
        def backward(ctx, g):  # pragma: no cover
            raise NotImplementedError

    class _FlashAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            s, b, heads, _ = q.shape
            out = torch.nn.functional.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True)
            out = out.permute(2, 0, 1, 3).contiguous()
            lse = torch.zeros(b, heads, s, dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, g):  # pragma: no cover
            raise NotImplementedError

    def rope(t, freqs):  # _apply_rotary_pos_emb_bshd with multi_latent_attention=True, mscale 1
        rot_dim = freqs.shape[-1]
        t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
        x1, x2 = t[..., 0::2], t[..., 1::2]
        t = torch.cat((x1, x2), dim=-1)
        cos_ = (torch.cos(freqs) * 1.0).to(t.dtype)
        sin_ = (torch.sin(freqs) * 1.0).to(t.dtype)
        a, b_ = torch.chunk(t, 2, dim=-1)
        rotated = torch.cat((-b_, a), dim=-1)
        t = (t * cos_) + (rotated * sin_)
        return torch.cat((t, t_pass), dim=-1)

    heads, qk, rd, vd, r_kv = cfg["heads"], cfg["qk"], cfg["rope"], cfg["v"], cfg["kv_rank"]
    s = x.shape[0]
    hidden = _te_norm(x, w["norm"])
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), torch.ones(rd // 2))
    freqs = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    q_compressed = _Linear.apply(hidden, w["q_down"])
    kv_combined = _Linear.apply(hidden, w["kv_down"])
    kv_compressed, k_pos_emb = torch.split(kv_combined, [r_kv, rd], dim=-1)

    def up_proj_and_rope(q_compressed, kv_compressed, k_pos_emb):  # qkv_up_proj_and_rope_apply
        q = _Linear.apply(q_compressed, w["q_up"])
        q = q.view(*q.size()[:-1], heads, qk + rd)
        kv = _Linear.apply(kv_compressed, w["kv_up"])
        kv = kv.view(*kv.size()[:-1], heads, qk + vd)
        k_pos_emb = torch.unsqueeze(k_pos_emb, -2)
        q_no_pe, q_pos_emb = torch.split(q, [qk, rd], dim=-1)
        k_no_pe, value = torch.split(kv, [qk, vd], dim=-1)
        q_pos_emb = rope(q_pos_emb, freqs)
        k_pos_emb = rope(k_pos_emb, freqs)
        query = torch.cat([q_no_pe, q_pos_emb], dim=-1)
        k_pos_emb = k_pos_emb.expand(-1, -1, heads, -1)
        key = torch.cat([k_no_pe, k_pos_emb], dim=-1)
        return query.contiguous(), key.contiguous(), value.contiguous()

    if checkpoint is None:
        query, key, value = up_proj_and_rope(q_compressed, kv_compressed, k_pos_emb)
    else:
        query, key, value = checkpoint.checkpoint(up_proj_and_rope, q_compressed, kv_compressed, k_pos_emb)
    out = _FlashAttention.apply(query, key, value)
    if checkpoint is not None:
        checkpoint.discard_output_and_register_recompute(out)
    return _Linear.apply(out.view(*out.shape[:2], -1), w["proj"])


@pytest.mark.parametrize("up_proj", [False, True])
def test_mla_attention_matches_what_torch_saves(up_proj, monkeypatch):
    """A tiny MLA sub-layer (s 16, b 2, h 32, 4 heads, q rank 24, kv rank 16, q/k heads 8 + 4 rope, v 8, bf16) run
    through MLASelfAttention's code path on CPU: the bytes autograd holds equal mla_attention_saved's (the unfused
    RoPE's cos/sin tables included; the splits, cats, expand and the kv up-projection's contiguous copy as counted).
    ``up_proj``: ``--recompute-granularity selective --recompute-modules mla_up_proj``, run through megatron-core's own
    CheckpointWithoutOutput (its CUDA RNG-state capture replaced by the CPU one: this machine has no CUDA); the
    recomputed forward is what the planner prices (megatron_recompute.mla_up_proj_work), checked by hand below."""
    import torch
    from megatron.core.tensor_parallel import random as mc_random

    torch.manual_seed(0)
    s, b, h, heads, r_q, r_kv, qk, rd, vd = 16, 2, 32, 4, 24, 16, 8, 4, 8
    bf = torch.bfloat16

    def p(*shape):
        return torch.randn(*shape, dtype=bf, requires_grad=True)

    w = {
        "norm": torch.ones(h, dtype=bf, requires_grad=True),
        "q_down": p(r_q, h),
        "kv_down": p(r_kv + rd, h),
        "q_up": p(heads * (qk + rd), r_q),
        "kv_up": p(heads * (qk + vd), r_kv),
        "proj": p(h, heads * vd),
    }
    arch = {
        "hidden_size": h,
        "num_attention_heads": heads,
        "normalization": "RMSNorm",
        "activation": "swiglu",
        "dropout": 0.0,
        "multi_latent_attention": True,
        "q_lora_rank": r_q,
        "kv_lora_rank": r_kv,
        "qk_head_dim": qk,
        "qk_pos_emb_head_dim": rd,
        "v_head_dim": vd,
    }
    x = p(s, b, h)
    checkpoint = None
    if up_proj:
        monkeypatch.setattr(mc_random, "_get_all_rng_states", lambda: (torch.get_rng_state(), None, None))
        checkpoint = mc_random.CheckpointWithoutOutput(fp8=None)  # MLASelfAttention passes config.fp8, None in bf16
    cfg = {"heads": heads, "qk": qk, "rope": rd, "v": vd, "kv_rank": r_kv}
    measured, _ = _saved_bytes(lambda: _megatron_mla_forward(x, w, cfg, checkpoint), list(w.values()))
    rc, modules = ("selective", frozenset({"mla_up_proj"})) if up_proj else ("none", frozenset({"core_attn"}))
    terms = mla_attention_saved(LayerShape.from_architecture(arch), MLAShape.from_architecture(arch), s, b, recompute=rc, modules=modules)
    assert measured == kept_bytes(terms, rc)
    if up_proj:  # q, k, v and the cos/sin tables go; the kv latent's storage (with its rope part) replaces its copy
        full = mla_attention_saved(LayerShape.from_architecture(arch), MLAShape.from_architecture(arch), s, b)
        T = s * b
        assert kept_bytes(full) - measured == 2 * T * heads * (2 * (qk + rd) + vd) + 4 * 2 * s * rd - 2 * T * rd
