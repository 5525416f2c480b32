"""Mixture-of-experts decoder (Mixtral, DeepSeek-V3 and Qwen3-MoE shapes): routed SwiGLU experts, dropless.

A model file for `planner`. Pick a size with ``--model-arg preset=NAME`` (see
PRESETS) and override fields, e.g. ``--model-arg num_experts=16 --model-arg
top_k=4``. Every decoder layer is attention + a feed-forward part; the
feed-forward part is a dense SwiGLU MLP for the first ``first_k_dense`` layers
and for layers off the ``moe_layer_freq`` pattern (layer i >= first_k_dense is
MoE when (i - first_k_dense) % moe_layer_freq == 0), and an MoE layer otherwise:

* a router (``router=softmax``: softmax over the expert logits, top-k, the
  k weights renormalised when ``norm_topk`` (Mixtral, Qwen3); ``router=sigmoid``:
  DeepSeek-V3's sigmoid scores, top-k of score + a per-expert bias buffer
  (aux-loss-free balancing), the k scores normalised and scaled by
  ``routed_scale``);
* ``num_experts`` routed SwiGLU experts of width ``moe_ffn_dim``, held as 3-D
  weights [experts, in, out] and run as one grouped GEMM
  (``torch._grouped_mm``) over the token-expert pairs sorted by expert: every
  token reaches its k experts (dropless), every shape is static (the pairs are
  T x k whatever the routing), so torch.fx and torch.export trace it, and the
  GEMMs multiply T x k rows: top-k FLOPs, not all experts' (torch's CUDA and meta
  kernels of the grouped GEMM take bf16 only, so plan it at the default bf16; the
  CPU kernel takes any float dtype, which CPU smoke runs use);
* ``n_shared_experts`` always-on SwiGLU experts of width ``shared_ffn_dim``
  each (DeepSeek), run as one MLP of width n_shared x shared_ffn_dim.

Attention is grouped-query (``attention=gqa``, RoPE, optional per-head
``qk_norm`` as in Qwen3) or DeepSeek's multi-head latent attention
(``attention=mla``: low-rank q and kv projections, a decoupled RoPE key
shared by all heads; the value head stays ``v_head_dim`` wide, as the fused kernels
Megatron runs MLA with take it; ``mla_pad_v=1`` pads v to the q/k head dim inside attention,
as flash-attention-2 kernels need: 20% more attention-core FLOPs at 192/128, 4% of
DeepSeek-V3's forward at s = 4096). Not modelled: DeepSeek-V3's node-limited (group) routing
and multi-token-prediction module (neither changes the main model's
parameters or FLOPs per token), load-balancing losses (loss_fn is the
language-model loss only).

Published sizes the presets reproduce (tests/model/test_moe_model.py): Mixtral 8x7B
46.7B parameters / 12.9B active, Mixtral 8x22B 141B / 39B, DeepSeek-V3 671B /
37B (without its 14B MTP module), Qwen3-30B-A3B 30.5B / 3.3B, Qwen3-235B-A22B 235B / 22B.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

_MIXTRAL = dict(attention="gqa", router="softmax", norm_topk=1, first_k_dense=0, moe_layer_freq=1, n_shared_experts=0, shared_ffn_dim=0, qk_norm=0)
_MLA_OFF = dict(mla_pad_v=0, q_lora_rank=0, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0)

PRESETS = {
    # Mixtral 8x7B / 8x22B (Mistral AI, arXiv 2401.04088; the models' config.json): 8 experts, top-2, every layer MoE
    "mixtral-8x7b": dict(
        _MIXTRAL,
        **_MLA_OFF,
        n_layers=32,
        dim=4096,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim=14336,
        num_experts=8,
        top_k=2,
        moe_ffn_dim=14336,
        routed_scale=1.0,
        seq_len=4096,
        vocab_size=32000,
        rope_theta=1e6,
    ),
    "mixtral-8x22b": dict(
        _MIXTRAL,
        **_MLA_OFF,
        n_layers=56,
        dim=6144,
        n_heads=48,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim=16384,
        num_experts=8,
        top_k=2,
        moe_ffn_dim=16384,
        routed_scale=1.0,
        seq_len=4096,
        vocab_size=32768,
        rope_theta=1e6,
    ),
    # DeepSeek-V3 (arXiv 2412.19437, config.json): MLA, 3 dense layers, 256 routed experts top-8 + 1 shared, sigmoid router
    "deepseek-v3": dict(
        attention="mla",
        router="sigmoid",
        norm_topk=1,
        qk_norm=0,
        n_layers=61,
        dim=7168,
        n_heads=128,
        n_kv_heads=128,
        head_dim=128,
        ffn_dim=18432,
        first_k_dense=3,
        moe_layer_freq=1,
        num_experts=256,
        top_k=8,
        moe_ffn_dim=2048,
        n_shared_experts=1,
        shared_ffn_dim=2048,
        routed_scale=2.5,
        mla_pad_v=0,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        seq_len=4096,
        vocab_size=129280,
        rope_theta=10000.0,
    ),
    # Qwen3-30B-A3B (Qwen3 technical report arXiv 2505.09388, config.json): 128 experts top-8, head_dim 128 > dim / heads, QK-norm
    "qwen3-30b-a3b": dict(
        _MIXTRAL,
        **_MLA_OFF,
        n_layers=48,
        dim=2048,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        ffn_dim=6144,
        num_experts=128,
        top_k=8,
        moe_ffn_dim=768,
        routed_scale=1.0,
        seq_len=4096,
        vocab_size=151936,
        rope_theta=1e6,
    )
    | dict(qk_norm=1),
    # Qwen3-235B-A22B (the same report and family): 94 layers, 128 experts top-8 of width 1536
    "qwen3-235b-a22b": dict(
        _MIXTRAL,
        **_MLA_OFF,
        n_layers=94,
        dim=4096,
        n_heads=64,
        n_kv_heads=4,
        head_dim=128,
        ffn_dim=12288,
        num_experts=128,
        top_k=8,
        moe_ffn_dim=1536,
        routed_scale=1.0,
        seq_len=4096,
        vocab_size=151936,
        rope_theta=1e6,
    )
    | dict(qk_norm=1),
    # tiny shapes for tests and CPU smoke runs
    "moe-tiny": dict(
        _MIXTRAL,
        **_MLA_OFF,
        n_layers=4,
        dim=64,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_dim=128,
        num_experts=4,
        top_k=2,
        moe_ffn_dim=64,
        routed_scale=1.0,
        seq_len=32,
        vocab_size=256,
        rope_theta=10000.0,
    ),
    "deepseek-tiny": dict(
        attention="mla",
        router="sigmoid",
        norm_topk=1,
        qk_norm=0,
        n_layers=4,
        dim=64,
        n_heads=4,
        n_kv_heads=4,
        head_dim=16,
        ffn_dim=128,
        first_k_dense=1,
        moe_layer_freq=1,
        num_experts=8,
        top_k=2,
        moe_ffn_dim=32,
        n_shared_experts=1,
        shared_ffn_dim=32,
        routed_scale=2.5,
        mla_pad_v=0,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        seq_len=32,
        vocab_size=256,
        rope_theta=10000.0,
    ),
}

_TEXT = {"attention": ("gqa", "mla"), "router": ("softmax", "sigmoid")}
_FLOAT = ("routed_scale", "rope_theta")


def _config(preset="mixtral-8x7b", **overrides):
    """The preset's fields with ``overrides`` (strings from --model-arg) applied and checked."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    cfg = dict(PRESETS[preset])
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in cfg:
            raise ValueError(f"unknown model argument {key!r}; the fields are {', '.join(sorted(cfg))}")
        if key in _TEXT:
            if value not in _TEXT[key]:
                raise ValueError(f"{key} must be one of {', '.join(_TEXT[key])}, not {value!r}")
            cfg[key] = value
        else:
            cfg[key] = float(value) if key in _FLOAT else int(value)
    if not 1 <= cfg["top_k"] <= cfg["num_experts"]:
        raise ValueError(f"top_k must be between 1 and num_experts ({cfg['num_experts']}), not {cfg['top_k']}")
    if cfg["moe_layer_freq"] < 1 or not 0 <= cfg["first_k_dense"] <= cfg["n_layers"]:
        raise ValueError("moe_layer_freq must be >= 1 and first_k_dense between 0 and n_layers")
    if cfg["attention"] == "gqa" and cfg["n_heads"] % cfg["n_kv_heads"]:
        raise ValueError(f"n_heads ({cfg['n_heads']}) must be a multiple of n_kv_heads ({cfg['n_kv_heads']})")
    return cfg


def is_moe_layer(i, first_k_dense, moe_layer_freq):
    """Whether decoder layer ``i`` (0-based) has routed experts."""
    return i >= first_k_dense and (i - first_k_dense) % moe_layer_freq == 0


def rope_tables(head_dim, seq_len, theta=10000.0):
    """cos and sin tables, each (seq_len, head_dim // 2), float32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rope(x, rope):
    """Rotate (b, heads, s, d) by the first s rows of the tables."""
    s = x.size(2)
    cos, sin = rope[0, :s].to(x.dtype), rope[1, :s].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class GQAttention(nn.Module):
    """Grouped-query attention with RoPE; ``qk_norm`` adds Qwen3's per-head RMSNorm of q and k."""

    def __init__(self, dim, n_heads, n_kv_heads, head_dim, qk_norm):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim) if qk_norm else nn.Identity()

    def forward(self, x, rope):
        b, s, _ = x.shape
        q = self.q_norm(self.wq(x).view(b, s, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.wk(x).view(b, s, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class MLAttention(nn.Module):
    """DeepSeek multi-head latent attention: q through a rank-``q_lora_rank`` bottleneck (0: full rank), k and v
    from one rank-``kv_lora_rank`` latent, plus a ``qk_rope_head_dim`` RoPE key shared by all heads."""

    def __init__(self, dim, n_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, pad_v):
        super().__init__()
        self.pad_v = pad_v
        self.n_heads, self.nope, self.rope_dim, self.v_dim, self.kv_rank = n_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank
        qk_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, n_heads * qk_dim, bias=False)
        self.q_lora = bool(q_lora_rank)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)

    def forward(self, x, rope):
        b, s, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_lora else self.wq(x)
        q = q.view(b, s, self.n_heads, self.nope + self.rope_dim).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(b, s, self.n_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = apply_rope(k_pe.unsqueeze(1), rope).expand(b, self.n_heads, s, self.rope_dim)
        q = torch.cat([q_nope, apply_rope(q_pe, rope)], dim=-1)
        k = torch.cat([k_nope, k_pe], dim=-1)
        if self.pad_v and self.v_dim < q.size(-1):  # v padded to the q/k head dim, as flash-attention-2 kernels need
            v = F.pad(v, [0, q.size(-1) - self.v_dim])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)[..., : self.v_dim]
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim, ffn_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    """Top-k gate: (T, dim) -> expert ids (T, k) and their weights (T, k), float32."""

    def __init__(self, dim, num_experts, top_k, kind, norm_topk, routed_scale):
        super().__init__()
        self.top_k, self.kind, self.norm_topk, self.routed_scale = top_k, kind, norm_topk, routed_scale
        self.gate = nn.Linear(dim, num_experts, bias=False)
        if kind == "sigmoid":  # aux-loss-free balancing: a bias that only steers the choice (updated outside the gradient)
            self.register_buffer("expert_bias", torch.zeros(num_experts))

    def forward(self, x):
        logits = self.gate(x).float()
        if self.kind == "sigmoid":
            scores = logits.sigmoid()
            ids = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices
            weights = scores.gather(-1, ids)
        else:
            weights, ids = torch.topk(logits.softmax(dim=-1), self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights * self.routed_scale


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts as 3-D weights [experts, in, out], run as grouped GEMMs over rows sorted by expert."""

    def __init__(self, dim, num_experts, ffn_dim):
        super().__init__()
        self.num_experts = num_experts  # with the 3-D weights: how the planner finds routed experts (as transformers 5 writes them)
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))

    def forward(self, rows, offsets):
        """rows (N, dim) grouped by expert, ``offsets`` (experts,) int32 cumulative row counts -> (N, dim)."""
        w1, w3, w2 = (w.to(rows.dtype) for w in (self.w1, self.w3, self.w2))  # autocast does not cover the grouped GEMM
        h = F.silu(torch._grouped_mm(rows, w1, offs=offsets)) * torch._grouped_mm(rows, w3, offs=offsets)
        return torch._grouped_mm(h, w2, offs=offsets)


class MoE(nn.Module):
    """Router + routed experts (dropless) + shared experts."""

    def __init__(self, dim, num_experts, top_k, moe_ffn_dim, n_shared_experts, shared_ffn_dim, router, norm_topk, routed_scale):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = Router(dim, num_experts, top_k, router, norm_topk, routed_scale)
        self.experts = Experts(dim, num_experts, moe_ffn_dim)
        self.shared_experts = FeedForward(dim, n_shared_experts * shared_ffn_dim) if n_shared_experts else None

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        ids, weights = self.router(tokens)
        flat = ids.reshape(-1)  # (T k,): pair p is token p // k going to expert flat[p]
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        offsets = torch.cumsum(counts, dim=0).to(torch.int32)
        out_sorted = self.experts(tokens[order // self.top_k], offsets)
        out = out_sorted[torch.argsort(order)].view(-1, self.top_k, shape[-1])  # back to (T, k, dim)
        y = (out * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)
        if self.shared_experts is not None:
            y = y + self.shared_experts(tokens)
        return y.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, moe):
        super().__init__()
        self.attention_norm = RMSNorm(cfg["dim"])
        if cfg["attention"] == "mla":
            self.attention = MLAttention(
                cfg["dim"],
                cfg["n_heads"],
                cfg["q_lora_rank"],
                cfg["kv_lora_rank"],
                cfg["qk_nope_head_dim"],
                cfg["qk_rope_head_dim"],
                cfg["v_head_dim"],
                cfg["mla_pad_v"],
            )
        else:
            self.attention = GQAttention(cfg["dim"], cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"], cfg["qk_norm"])
        self.ffn_norm = RMSNorm(cfg["dim"])
        if moe:
            self.feed_forward = MoE(
                cfg["dim"],
                cfg["num_experts"],
                cfg["top_k"],
                cfg["moe_ffn_dim"],
                cfg["n_shared_experts"],
                cfg["shared_ffn_dim"],
                cfg["router"],
                cfg["norm_topk"],
                cfg["routed_scale"],
            )
        else:
            self.feed_forward = FeedForward(cfg["dim"], cfg["ffn_dim"])

    def forward(self, x, rope):
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class MoETransformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        rope_dim = cfg["qk_rope_head_dim"] if cfg["attention"] == "mla" else cfg["head_dim"]
        self.tok_embeddings = nn.Embedding(cfg["vocab_size"], cfg["dim"])
        self.register_buffer("rope", rope_tables(rope_dim, cfg["seq_len"], cfg["rope_theta"]), persistent=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, is_moe_layer(i, cfg["first_k_dense"], cfg["moe_layer_freq"])) for i in range(cfg["n_layers"])])
        self.norm = RMSNorm(cfg["dim"])
        self.output = nn.Linear(cfg["dim"], cfg["vocab_size"], bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h))


def build_model(preset="mixtral-8x7b", **overrides):
    return MoETransformer(_config(preset, **overrides))


def example_inputs(batch_size, preset="mixtral-8x7b", seq_len=None, vocab_size=None):
    cfg = _config(preset, seq_len=seq_len, vocab_size=vocab_size)
    return (torch.randint(0, cfg["vocab_size"], (batch_size, cfg["seq_len"])),)


def example_target(batch_size, preset="mixtral-8x7b", seq_len=None, vocab_size=None):
    cfg = _config(preset, seq_len=seq_len, vocab_size=vocab_size)
    return torch.randint(0, cfg["vocab_size"], (batch_size, cfg["seq_len"]))


def loss_fn(output, target):
    return F.cross_entropy(output.flatten(0, 1).float(), target.flatten(0, 1))


# ---- closed forms (parameters, FLOPs) of a configuration: what the tests hold the built model and the planner to ----


def _attention_params(cfg):
    d = cfg["dim"]
    if cfg["attention"] == "mla":
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        h, r_q, r_kv = cfg["n_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]
        q = d * r_q + r_q + r_q * h * qk if r_q else d * h * qk
        kv = d * (r_kv + cfg["qk_rope_head_dim"]) + r_kv + r_kv * h * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
        return q + kv + h * cfg["v_head_dim"] * d
    hd = cfg["head_dim"]
    q, kv = cfg["n_heads"] * hd, cfg["n_kv_heads"] * hd
    return d * (q + 2 * kv) + q * d + (2 * hd if cfg["qk_norm"] else 0)


def parameter_counts(preset="mixtral-8x7b", **overrides):
    """(total, active) parameters: active counts the top-k routed experts of each MoE layer, not all of them."""
    cfg = _config(preset, **overrides)
    d, E, k = cfg["dim"], cfg["num_experts"], cfg["top_k"]
    expert = 3 * d * cfg["moe_ffn_dim"]
    shared = 3 * d * cfg["n_shared_experts"] * cfg["shared_ffn_dim"]
    n_moe = sum(is_moe_layer(i, cfg["first_k_dense"], cfg["moe_layer_freq"]) for i in range(cfg["n_layers"]))
    n_dense = cfg["n_layers"] - n_moe
    per_layer = _attention_params(cfg) + 2 * d  # attention + its two norms
    common = cfg["n_layers"] * per_layer + n_dense * 3 * d * cfg["ffn_dim"] + n_moe * (d * E + shared) + 2 * cfg["vocab_size"] * d + d
    return common + n_moe * E * expert, common + n_moe * k * expert


def forward_flops_per_token(preset="mixtral-8x7b", **overrides):
    """Matmul FLOPs of one token's forward (2 per multiply-add): every linear layer at 2 x its weights, the routed
    experts k times (not E), the router over all experts, and causal attention's two s x s products counted in full
    (2 x 2 x s x heads x head dim per token, as torch's counter counts SDPA); the embedding lookup is free."""
    cfg = _config(preset, **overrides)
    d, s = cfg["dim"], cfg["seq_len"]
    _, active = parameter_counts(preset, **overrides)
    norms = cfg["n_layers"] * 2 * d + d + (2 * cfg["head_dim"] if cfg["qk_norm"] and cfg["attention"] == "gqa" else 0) * cfg["n_layers"]
    if cfg["attention"] == "mla":
        norms += cfg["n_layers"] * (cfg["q_lora_rank"] + cfg["kv_lora_rank"])
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        v = max(qk, cfg["v_head_dim"]) if cfg["mla_pad_v"] else cfg["v_head_dim"]
    else:
        qk = v = cfg["head_dim"]
    matmul_params = active - cfg["vocab_size"] * d - norms
    attention = cfg["n_layers"] * 2 * s * cfg["n_heads"] * (qk + v)
    return 2 * matmul_params + attention


def architecture(preset="mixtral-8x7b", **overrides):
    """The transformer and MoE shape under Megatron-LM's names (README.md's architecture() table).

    ``kv_channels`` and ``qk_layernorm`` (Qwen3: head_dim 128 is not dim / heads; per-head q/k RMSNorm) are given
    for Megatron's --kv-channels and --qk-layernorm."""
    cfg = _config(preset, **overrides)
    mla = cfg["attention"] == "mla"
    return {
        "num_layers": cfg["n_layers"],
        "hidden_size": cfg["dim"],
        "num_attention_heads": cfg["n_heads"],
        "num_query_groups": None if mla else cfg["n_kv_heads"],  # MLA excludes grouped-query attention
        "kv_channels": None if mla else cfg["head_dim"],
        # MLA's latent norms (q_norm, kv_norm) are Megatron's q_layernorm / kv_layernorm, which its layer spec builds only
        # with --qk-layernorm (megatron/core/models/gpt/gpt_layer_specs.py, core_v0.16.1)
        "qk_layernorm": bool(cfg["qk_norm"]) or mla,
        "ffn_hidden_size": cfg["ffn_dim"],
        "seq_length": cfg["seq_len"],
        "max_position_embeddings": cfg["seq_len"],
        "vocab_size": cfg["vocab_size"],
        "normalization": "RMSNorm",
        "norm_epsilon": 1e-6,
        "activation": "swiglu",
        "position_embedding": "rope",
        "rotary_base": cfg["rope_theta"],
        "tied_embeddings": False,
        "bias": False,
        "dropout": 0.0,
        "block_path": "layers",
        "num_experts": cfg["num_experts"],
        "moe_router_topk": cfg["top_k"],
        "moe_ffn_hidden_size": cfg["moe_ffn_dim"],
        "moe_shared_expert_intermediate_size": cfg["n_shared_experts"] * cfg["shared_ffn_dim"] or None,
        "moe_layer_freq": [int(is_moe_layer(i, cfg["first_k_dense"], cfg["moe_layer_freq"])) for i in range(cfg["n_layers"])],
        "moe_router_score_function": cfg["router"],
        "moe_router_load_balancing_type": "none",  # loss_fn adds no balancing loss
        "moe_router_pre_softmax": (cfg["router"] == "softmax" and not cfg["norm_topk"]) or None,  # softmax over all experts, no renormalization
        "moe_router_enable_expert_bias": cfg["router"] == "sigmoid" or None,
        "moe_router_topk_scaling_factor": cfg["routed_scale"] if cfg["routed_scale"] != 1.0 else None,
        "multi_latent_attention": mla or None,
        "q_lora_rank": (cfg["q_lora_rank"] or None) if mla else None,
        "kv_lora_rank": cfg["kv_lora_rank"] if mla else None,
        "qk_head_dim": cfg["qk_nope_head_dim"] if mla else None,
        "qk_pos_emb_head_dim": cfg["qk_rope_head_dim"] if mla else None,
        "v_head_dim": cfg["v_head_dim"] if mla else None,
    }
