"""Bytes Megatron's mixture-of-experts, multi-latent-attention and q/k-norm layers save for backward, per GPU and
micro-batch (torch-free closed form; the dense terms are planner.engines.megatron.activations').

Megatron-Core core_v0.16.1 builds these layers from flags (megatron/core/models/gpt/gpt_layer_specs.py,
``get_gpt_layer_with_transformer_engine_spec``): an MoE layer has a separate pre-MLP ``TENorm`` (``pre_mlp_layernorm``
is ``backend.layer_norm() if num_experts``) and a ``MoELayer`` (megatron/core/transformer/moe/moe_layer.py); MLA layers
an unfused input ``TENorm`` and ``MLASelfAttention`` (megatron/core/transformer/multi_latent_attention.py). The
planner renders ``--moe-grouped-gemm --moe-token-dispatcher-type alltoall`` (TEGroupedMLP, MoEAlltoAllTokenDispatcher),
no ``--moe-permute-fusion`` / ``--moe-router-fusion`` / ``--moe-router-dtype`` (their defaults: the unfused
torch paths of moe_utils.py, probabilities in the input dtype) and, for MLA, ``--rope-type rope --no-rope-fusion``.

Notation (per GPU): ``T`` tokens of the residual stream, ``s / cp x b`` split over tp with sequence parallelism (MoELayer
raises without it when tp > 1); ``S = s / cp x b`` the tokens a tensor-parallel GEMM's output holds; ``E`` experts,
``k`` = top-k, ``N = T x k x etp`` rows entering the grouped GEMMs: each GPU routes T x k token-expert pairs over its
ep group and, **in expectation with balanced routing (dropless)**, receives as many as it sends (E / ep local experts
receive ep x T x k x (E / ep) / E = T x k), then the expert-TP all-gather (``gather_from_sequence_parallel_region`` in
``dispatch_postprocess``) multiplies them by etp; ep cancels. Real routing is imbalanced: the most loaded GPU holds more.

Kinds as in megatron_activations (``gemm``: kept only by a weight GEMM, 1 byte under FP8; ``shared``: a GEMM and
another operator, FP8 adds a 1-byte copy; ``core``: dropped by ``--recompute-granularity selective``, whose default
``--recompute-modules`` is core_attn only: TransformerConfig.__post_init__). Left out, each under 1% of a layer: the
FP8 per-expert row padding to 16 (``Fp8Padding``), the int64 token counts per expert, and the dispatcher's attributes
(``self.probs``, ``self.routing_map``: one micro-batch's, overwritten by the next forward, not one per micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.engines.megatron.activations import CORE_ATTN, MASK_BYTES, STAT_BYTES, LayerShape, Saved, layer_saved
from planner.engines.megatron.architecture import architecture_defaults

#: bytes of an int64 index (torch.topk's indices, masked_select's token indices) and of a bool routing map element
INDEX_BYTES = 8.0
BOOL_BYTES = 1.0
#: the balancing losses that save routing scores over all experts (sinkhorn is refused: it keeps its own iterates)
AUX_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


@dataclass(frozen=True)
class MoEShape:
    """The routed and shared experts of one Megatron MoE layer, from an ``architecture()`` dict."""

    experts: int
    topk: int
    ffn: int
    shared_ffn: int
    shared_gate: bool
    score: str
    pre_softmax: bool
    groups: int
    group_topk: int
    aux_loss: bool

    @classmethod
    def from_architecture(cls, arch: dict[str, Any]) -> MoEShape:
        a = architecture_defaults(arch)
        balance = a["moe_router_load_balancing_type"]
        if balance not in AUX_LOSSES + ("none",):
            raise ValueError(f"no closed form for --moe-router-load-balancing-type {balance}")
        return cls(
            experts=int(a["num_experts"]),
            topk=int(a["moe_router_topk"]),
            ffn=int(a.get("moe_ffn_hidden_size") or LayerShape.from_architecture(arch).ffn),
            shared_ffn=int(a.get("moe_shared_expert_intermediate_size") or 0),
            shared_gate=bool(a["moe_shared_expert_gate"]),
            score=str(a["moe_router_score_function"]),
            pre_softmax=bool(a["moe_router_pre_softmax"]),
            groups=int(a.get("moe_router_num_groups") or 0),
            group_topk=int(a.get("moe_router_group_topk") or 0),
            aux_loss=balance in AUX_LOSSES and float(a["moe_aux_loss_coeff"] or 0.0) > 0,
        )


@dataclass(frozen=True)
class MLAShape:
    """Multi-latent attention widths (MLATransformerConfig); ``q_lora_rank`` 0: a full-rank query projection."""

    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_head_dim: int
    rope_dim: int
    v_head_dim: int
    latent_norms: bool

    @classmethod
    def from_architecture(cls, arch: dict[str, Any]) -> MLAShape:
        return cls(
            heads=int(arch["num_attention_heads"]),
            q_lora_rank=int(arch.get("q_lora_rank") or 0),
            kv_lora_rank=int(arch["kv_lora_rank"]),
            qk_head_dim=int(arch["qk_head_dim"]),
            rope_dim=int(arch["qk_pos_emb_head_dim"]),
            v_head_dim=int(arch["v_head_dim"]),
            latent_norms=bool(arch.get("qk_layernorm")),
        )


def router_saved(moe: MoEShape, tokens: float, dtype_bytes: float = 2.0) -> tuple[Saved, ...]:
    """What TopKRouter.forward and the permutation keep for ``tokens`` (T) tokens (bytes), moe_utils.py core_v0.16.1:

    * ``topk_routing_with_score_function`` (unfused), counting what the graph still holds after the forward: softmax
      after the top-k (``moe_router_pre_softmax`` off):
      torch.topk keeps its int64 indices [T, k] and the fp32 softmax its output [T, k] (``dtype=torch.float32``);
      pre-softmax: the fp32 softmax over all experts [T, E], then the indices; sigmoid: ``torch.sigmoid(logits.float())``
      keeps its fp32 output [T, E], torch.gather its input (the scores cast back to the input dtype, [T, E]) and its
      indices [T, k] (the top-k of score + expert bias keeps the same indices), the division by the sum both operands
      (the gathered scores [T, k] and the sum [T, 1], input dtype); ``zeros_like(logits).scatter(1, top_indices,
      probs)`` reuses the indices;
    * group-limited routing (``group_limited_topk``): masked_fill keeps its bool mask [T, E] (the group scores' top-ks
      feed only the mask, built without gradient: their nodes and indices are freed after the forward);
    * a balancing loss (``compute_routing_scores_for_aux_loss``): softmax keeps fp32 scores [T, E] (sigmoid: the
      sigmoid output and the normalising sum, input dtype); its top-k only builds the routing map (freed likewise);
    * ``permute`` (unfused, token_dispatcher.py ``dispatch_preprocess``): ``probs.T.contiguous().masked_select(map)``
      keeps its input, the transposed probabilities [E, T] (input dtype), and the transposed bool map [E, T];
      ``tokens.index_select(0, sorted_indices)`` its int64 indices [T k] (``unpermute``'s scatter_add_ reuses them:
      one storage).

    torch's autograd formulas decide what each call keeps (gather and masked_select keep their input, topk only its
    indices): tests/engines/test_megatron_moe_activations.py runs these calls and counts the saved storages.

    The router's GEMM input (RouterGatingLinearFunction saves ``inp``) is the pre-MLP norm output: in
    :func:`moe_mlp_saved`."""
    T, E, k, d = tokens, moe.experts, moe.topk, dtype_bytes
    out = [Saved("router top-k indices", INDEX_BYTES * T * k, "other", "mlp")]
    if moe.score == "sigmoid":
        out.append(Saved("router sigmoid output (fp32)", STAT_BYTES * T * E, "other", "mlp"))
        out.append(Saved("router scores in the input dtype (gather's input)", d * T * E, "other", "mlp"))
        if k > 1:  # probs = scores / scores.sum(): top-1 keeps the score itself
            out.append(Saved("router top-k scores and their sum (normalisation)", d * T * (k + 1), "other", "mlp"))
    elif moe.pre_softmax:
        out.append(Saved("router softmax output (fp32, all experts)", STAT_BYTES * T * E, "other", "mlp"))
    else:
        out.append(Saved("router softmax output (fp32, top-k)", STAT_BYTES * T * k, "other", "mlp"))
    if moe.groups and moe.group_topk:
        out.append(Saved("group-limited routing mask", BOOL_BYTES * T * E, "other", "mlp"))
    if moe.aux_loss:
        if moe.score == "sigmoid":
            out.append(Saved("balancing-loss scores", d * T * (E + 1), "other", "mlp"))
        else:
            out.append(Saved("balancing-loss scores (fp32 softmax)", STAT_BYTES * T * E, "other", "mlp"))
    out.append(Saved("routing probabilities, transposed (masked_select's input)", d * T * E, "other", "mlp"))
    out.append(Saved("routing map (permute's mask)", BOOL_BYTES * T * E, "other", "mlp"))
    out.append(Saved("permutation indices", INDEX_BYTES * T * k, "other", "mlp"))
    return tuple(out)


def experts_saved(moe: MoEShape, rows: float, hidden: int, etp: int = 1, swiglu: bool = True, dtype_bytes: float = 2.0) -> tuple[Saved, ...]:
    """What TEGroupedMLP.forward keeps for ``rows`` (N) token-expert rows on this GPU (bytes), experts.py core_v0.16.1:
    ``linear_fc1`` (TE GroupedLinear) its input rows [N, h] (the all-to-all's output, sorted by local expert:
    ``sort_chunks_by_idxs`` is a split + cat that keeps nothing); the fused ``weighted_bias_swiglu_impl``
    (megatron/core/fusions/fused_bias_swiglu.py, WeightedSwiGLUFunction) its input, FC1's output [N, 2 f / etp], and the
    permuted probabilities [N, 1] (input dtype); ``linear_fc2`` the activation output [N, f / etp]. The all-to-alls
    (``all_to_all``) and the expert-TP all-gather / reduce-scatter keep no tensors."""
    d, f = dtype_bytes, rows * moe.ffn / etp
    return (
        Saved("expert FC1 input rows", d * rows * hidden, "gemm", "mlp"),
        Saved("expert FC1 output (activation input)", d * f * (2 if swiglu else 1), "other", "mlp"),
        Saved("permuted probabilities (weighted activation)", d * rows, "other", "mlp"),
        Saved("expert activation output (FC2 input)", d * f, "gemm", "mlp"),
    )


def shared_experts_saved(
    moe: MoEShape, tokens: float, gemm_tokens: float, hidden: int, tp: int, swiglu: bool = True, dtype_bytes: float = 2.0
) -> tuple[Saved, ...]:
    """What SharedExpertMLP (megatron/core/transformer/moe/shared_experts.py, an MLP of width
    ``moe_shared_expert_intermediate_size`` split over tp, TEColumnParallelLinear / TERowParallelLinear) keeps besides its
    input: FC1's output [S, 2 fs / tp] (``bias_swiglu_impl``) and FC2's input [S, fs / tp]; with
    ``--moe-shared-expert-gate`` the gate's sigmoid output [T, 1] and the gated product's other operand, the MLP's
    output [T, h]. ``tokens``: T, ``gemm_tokens``: S."""
    if not moe.shared_ffn:
        return ()
    d, f = dtype_bytes, gemm_tokens * moe.shared_ffn / tp
    out = [
        Saved("shared-expert FC1 output (activation input)", d * f * (2 if swiglu else 1), "other", "mlp"),
        Saved("shared-expert activation output (FC2 input)", d * f, "gemm", "mlp"),
    ]
    if moe.shared_gate:
        out.append(Saved("shared-expert gate and gated output", d * tokens * (hidden + 1), "other", "mlp"))
    return tuple(out)


def moe_mlp_saved(
    shape: LayerShape,
    moe: MoEShape,
    tokens: int,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    etp: int = 1,
    dtype_bytes: float = 2.0,
) -> tuple[Saved, ...]:
    """Every tensor one MoE sub-layer keeps for backward on one GPU (bytes per micro-batch of ``micro_batch`` samples of
    ``tokens`` tokens: ``seq / cp``): the pre-MLP TENorm's input and fp32 statistics (transformer_layer.py
    ``_forward_mlp``), its output (kept by the router's GEMM and, with shared experts, by their FC1: ``shared``),
    :func:`router_saved`, :func:`experts_saved` over N = T x k x etp rows, :func:`shared_experts_saved` and the
    bias-dropout-add mask when the hidden dropout is > 0."""
    S = float(tokens * micro_batch)
    T = S / (tp if sequence_parallel else 1)
    d, h = dtype_bytes, shape.hidden
    norm_stats = (1 if shape.rmsnorm else 2) * STAT_BYTES * T
    out = [Saved("mlp norm input", d * T * h, "other", "mlp"), Saved("mlp norm statistics", norm_stats, "other", "mlp")]
    out.append(Saved("mlp norm output (router and shared-expert input)", d * T * h, "shared" if moe.shared_ffn else "other", "mlp"))
    out += router_saved(moe, T, d)
    out += experts_saved(moe, T * moe.topk * etp, h, etp, shape.swiglu, d)
    out += shared_experts_saved(moe, T, S, h, tp, shape.swiglu, d)
    if shape.dropout > 0:
        out.append(Saved("mlp dropout mask", MASK_BYTES * T * h, "other", "mlp"))
    return tuple(out)


def qk_norm_saved(shape: LayerShape, tokens: int, micro_batch: int, tp: int = 1, dtype_bytes: float = 2.0) -> tuple[Saved, ...]:
    """What ``--qk-layernorm`` adds to a GQA attention sub-layer (SelfAttention's ``q_layernorm`` / ``k_layernorm``,
    TENorm on [S, heads / tp, d] and [S, groups / tp, d] before RoPE, attention.py core_v0.16.1): each norm keeps its
    input (TE's norm op saves the contiguous input, q and k at their own widths) and its fp32 statistics, one per head
    and token (RMSNorm 1/sigma; LayerNorm mean and 1/sigma); the attention kernel keeps the normed, rotated q and k."""
    S = float(tokens * micro_batch)
    q = S * shape.heads * shape.kv_channels / tp
    kv = S * shape.groups * shape.kv_channels / tp
    stats = (1 if shape.rmsnorm else 2) * STAT_BYTES * S * (shape.heads + shape.groups) / tp
    return (
        Saved("q norm input", dtype_bytes * q, "other", "attention"),
        Saved("k norm input", dtype_bytes * kv, "other", "attention"),
        Saved("q/k norm statistics", stats, "other", "attention"),
    )


def mla_attention_saved(
    shape: LayerShape,
    mla: MLAShape,
    tokens: int,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    dtype_bytes: float = 2.0,
    recompute: str = "none",
    modules: frozenset[str] = CORE_ATTN,
) -> tuple[Saved, ...]:
    """Every tensor one MLA attention sub-layer keeps for backward on one GPU (bytes), multi_latent_attention.py
    core_v0.16.1 ``MLASelfAttention.get_query_key_value_tensors`` and ``MultiLatentAttention.forward``:

    * the input TENorm (not fused: the down projections are TELinear ``parallel_mode='duplicated'``, on the GPU's own T
      tokens): its input and statistics, and its output, which the q and kv down projections both keep: one bf16 storage,
      or under FP8 two 1-byte copies (one per TE Linear): 2 bytes per element either way (kind ``other``);
    * the up projections (TEColumnParallelLinear; with ``--qk-layernorm`` TELayerNormColumnParallelLinear, which also
      keeps its input and statistics) keep their inputs, q_compressed [T, q_lora_rank] and kv_compressed
      [T, kv_lora_rank] (with sequence parallelism the local shard, gathered again in backward; kv_compressed is a split
      view of the down projection's output, which TE's ``prepare_forward`` copies contiguous, so the copy is what is
      kept, transformer_engine/pytorch/module/base.py); a full-rank query
      (no q_lora_rank) reads the norm output, kept already;
    * unfused RoPE (``--no-rope-fusion``; rope_utils.py ``_apply_rotary_pos_emb_bshd``) keeps cos and sin
      [s / cp, rope_dim] in the input dtype for q and again for k; the splits, the cat and the expand keep nothing;
    * core attention (TE DotProductAttention) q and k [S, heads / tp, qk_head_dim + rope_dim], v [S, heads / tp,
      v_head_dim], its output [S, heads / tp, v_head_dim] (the projection's input, ``shared``) and the fp32 softmax
      statistics (``core``); then the dropout mask when the hidden dropout is > 0.

    ``recompute`` ``selective`` recomputes ``modules``; what they drop is of kind ``core``. ``core_attn`` as
    megatron_activations.layer_saved. ``mla_up_proj`` runs ``qkv_up_proj_and_rope_apply`` (the up projections, their
    fused latent norms and RoPE) in a ``CheckpointWithoutOutput`` (tensor_parallel/random.py): under no_grad, keeping
    only its inputs, detached views of their storages: q_compressed [T, q_lora_rank] and kv_compressed, a split view of
    the kv down projection's output, so its whole storage [T, kv_lora_rank + rope_dim]; with sequence parallelism
    k_pos_emb is gathered to [S, rope_dim], a storage of its own. Its outputs q, k and v are freed once the core attention
    has run (``discard_output_and_register_recompute``) and rebuilt before its backward: the latent norms' statistics,
    the up projections' inputs (the normed latents), RoPE's cos and sin and q, k, v go. The rotary table is one tensor
    for all layers, not counted."""
    S = float(tokens * micro_batch)
    T = S / (tp if sequence_parallel else 1)
    d, h = dtype_bytes, shape.hidden
    heads = mla.heads / tp
    stat = (1 if shape.rmsnorm else 2) * STAT_BYTES
    core_attn = recompute != "selective" or "core_attn" in modules
    up = recompute == "selective" and "mla_up_proj" in modules
    inside = "core" if up else "other"  # what the up-projection checkpoint no longer keeps
    out = [
        Saved("attention norm input", d * T * h, "other", "attention"),
        Saved("attention norm statistics", stat * T, "other", "attention"),
        Saved("attention norm output (q and kv down-projection input)", d * T * h, "other", "attention"),
    ]
    for name, width in (("q", mla.q_lora_rank), ("kv", mla.kv_lora_rank)):
        if not width:
            continue
        if up:
            stored = width + (mla.rope_dim if name == "kv" else 0)  # kv_compressed's storage is the down projection's output
            out.append(Saved(f"{name} latent (up-projection checkpoint input)", d * T * stored, "other", "attention"))
            if mla.latent_norms:
                out.append(Saved(f"{name} latent norm statistics", stat * T, "core", "attention"))
                out.append(Saved(f"{name} up-projection input", d * T * width, "core", "attention"))
            continue
        if mla.latent_norms:
            out.append(Saved(f"{name} latent norm input", d * T * width, "other", "attention"))
            out.append(Saved(f"{name} latent norm statistics", stat * T, "other", "attention"))
        out.append(Saved(f"{name} up-projection input", d * T * width, "gemm", "attention"))
    if up and sequence_parallel and tp > 1:
        out.append(Saved("k_pos_emb, gathered (up-projection checkpoint input)", d * S * mla.rope_dim, "other", "attention"))
    out.append(Saved("RoPE cos and sin (unfused, q and k)", 2 * 2 * d * tokens * mla.rope_dim, inside, "attention"))
    qk = S * heads * (mla.qk_head_dim + mla.rope_dim)
    v = S * heads * mla.v_head_dim
    out += [Saved("q", d * qk, inside, "attention"), Saved("k", d * qk, inside, "attention"), Saved("v", d * v, inside, "attention")]
    out.append(Saved("softmax statistics", STAT_BYTES * S * heads, "core" if core_attn else "other", "attention"))
    shared = "gemm" if recompute == "selective" and core_attn else "shared"
    out.append(Saved("attention output (projection input)", d * v, shared, "attention"))
    if shape.dropout > 0:
        out.append(Saved("attention dropout mask", MASK_BYTES * T * h, "other", "attention"))
    return tuple(out)


def megatron_layer_saved(
    arch: dict[str, Any],
    moe_layer: bool,
    tokens: int,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    etp: int = 1,
    dtype_bytes: float = 2.0,
    recompute: str = "none",
    modules: frozenset[str] = CORE_ATTN,
    kernel: str = "flash",
) -> tuple[Saved, ...]:
    """Every tensor one of Megatron's layers for ``arch`` keeps (bytes per micro-batch): the attention sub-layer (GQA
    as megatron_activations.layer_saved, plus :func:`qk_norm_saved` with ``qk_layernorm``; or
    :func:`mla_attention_saved`), then the MLP (the dense TE MLP of ``ffn_hidden_size``; an MoE layer's
    :func:`moe_mlp_saved`). Under ``selective`` recomputation ``modules`` (``--recompute-modules``) decide what goes
    (kind ``core``); ``mlp`` recomputes dense MLPs only (TransformerLayer sets ``recompute_mlp`` only without MoE).
    ``kernel``: the dense attention core's, ``flash`` (fused) or ``explicit`` (unfused softmax, its s x s tensors kept;
    multi-latent attention is priced fused either way)."""
    shape = LayerShape.from_architecture(arch)
    mode = "selective" if recompute == "selective" else "none"
    dense = layer_saved(shape, tokens, micro_batch, tp, sequence_parallel, dtype_bytes, attention=kernel, recompute=mode, modules=modules)
    if arch.get("multi_latent_attention"):
        attention = mla_attention_saved(shape, MLAShape.from_architecture(arch), tokens, micro_batch, tp, sequence_parallel, dtype_bytes, mode, modules)
    else:
        attention = tuple(t for t in dense if t.part == "attention")
        if arch.get("qk_layernorm"):
            attention += qk_norm_saved(shape, tokens, micro_batch, tp, dtype_bytes)
    if moe_layer:
        mlp = moe_mlp_saved(shape, MoEShape.from_architecture(arch), tokens, micro_batch, tp, sequence_parallel, etp, dtype_bytes)
    else:
        mlp = tuple(t for t in dense if t.part == "mlp")
    return attention + mlp
