"""The transformers -> Megatron-LM shape map: the architecture() of a decoder-only transformers config, for the model
types whose decoder layer Megatron-LM's GPT layer runs as transformers does, and why none is derived for the others.

Torch-free and transformers-free: it reads a config object's attributes (transformers 5's ``PretrainedConfig``), as
``hf:`` specs and model files that build a transformers model both give it (planner.planning asks the engines that
build from architecture(), :meth:`planner.engines.base.Engine.architecture_from_config`).
"""

from __future__ import annotations

from typing import Any


def _text_config(config: Any) -> Any:
    """The config of the model's text part: the config itself, its ``text_config``, or where it has a text encoder
    and a decoder (MusicGen), whose plain ``get_text_config()`` raises as ambiguous, the decoder's."""
    if not hasattr(config, "get_text_config"):
        return config
    try:
        return config.get_text_config()
    except ValueError:
        return config.get_text_config(decoder=True)


#: transformers activation names -> Megatron's MLP, for the ungated MLP (GPT-2: fc, activation, proj) ...
_HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu", "relu2": "squared_relu"}
#: ... and for the gated one (the other MEGATRON_HF_TYPES: down(act(gate x) * up x)), which Megatron runs only as SwiGLU
_HF_GATED_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu"}
#: the MEGATRON_HF_TYPES whose MLP is ungated
_HF_UNGATED_TYPES = ("gpt2",)


def hf_activation(model_type: str, act_name: str) -> str:
    """Megatron's name for a transformers MLP activation (planner.engines.megatron.architecture.ACTIVATIONS), or a name Megatron has not
    (a gated GeLU, an ungated SiLU), which architecture_problem then refuses."""
    if model_type in _HF_UNGATED_TYPES:
        return _HF_ACTIVATIONS.get(act_name, act_name)
    return _HF_GATED_ACTIVATIONS.get(act_name, f"gated {act_name}")


#: transformers model types whose decoder layer Megatron-LM's GPT layer runs as transformers does (the layer's norms,
#: attention, MLP and residuals; the MoE types' routing is checked by :func:`hf_moe_architecture`). Other decoders differ
#: in ways Megatron's flags cannot express: Gemma's gated GeLU, sandwich norms, logit soft-capping and embedding scale,
#: OLMo's weightless LayerNorm, OLMo 2's and GLM-4's post-norms, GPT-NeoX's and Falcon's parallel residual, Granite's
#: multipliers, SmolLM3's layers without rope. Phi-3's fused projections (transformers 5 Phi3Attention.qkv_proj,
#: Phi3MLP.gate_up_proj, both without bias; the MLP is ``up * silu(gate)`` with gate the first half) are Megatron's own
#: fused linear_qkv and linear_fc1 under --swiglu (the first half gated), so its layer is Llama's; its LongRoPE variants
#: keep the rope type by name and are refused by rope_problems.
MEGATRON_HF_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "stablelm", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
#: MEGATRON_HF_TYPES whose attention has q/k/v biases and no other linear biases (transformers' Qwen2Attention,
#: Qwen2MoeAttention: ``bias=True`` on q_proj, k_proj and v_proj)
QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")


def hf_architecture_gap(config: Any, seq_len: int) -> str | None:
    """Why no Megatron GPT shape is derived from a transformers ``config`` at ``seq_len`` tokens (None: one is)."""
    if getattr(config, "is_encoder_decoder", False):
        return f"an encoder-decoder ({config.model_type})"
    c = _text_config(config)
    if c.model_type not in MEGATRON_HF_TYPES:
        return (
            f"model type {c.model_type!r}: Megatron-LM's GPT layer runs the decoder layers of {', '.join(MEGATRON_HF_TYPES)} as transformers does, and no other"
        )
    if getattr(c, "use_parallel_residual", False):  # StableLM's option: attention and MLP from one norm, summed
        return "a parallel attention + MLP residual (use_parallel_residual), which Megatron's GPT layer does not run"
    window = getattr(c, "sliding_window", None)
    if isinstance(window, int) and window < seq_len and getattr(c, "use_sliding_window", True):
        return f"sliding-window attention over {window} tokens at a sequence of {seq_len}, which the rendered flags would run as full attention"
    if hf_moe_architecture(c) is None:
        return f"a mixture of experts ({c.model_type}) whose routing Megatron's MoE layer does not run as transformers does"
    return None


def hf_architecture(config: Any, seq_len: int) -> dict[str, Any] | None:
    """architecture() of a decoder-only transformers config (Megatron-LM's GPT model shape), else None
    (:func:`hf_architecture_gap` says why).

    Gated MLPs (Llama family: ``intermediate_size`` with a SiLU gate) map to
    swiglu, GPT-2's ``gelu_new`` to gelu; RMSNorm for configs with
    ``rms_norm_eps``, LayerNorm otherwise; rope for ``rope_theta`` /
    ``rope_parameters`` configs, learned absolute positions otherwise.
    """
    if hf_architecture_gap(config, seq_len) is not None:
        return None
    c = _text_config(config)
    moe = hf_moe_architecture(c)
    assert moe is not None  # hf_architecture_gap checked it
    mla = bool(moe.get("multi_latent_attention"))
    get = lambda *names, default=None: next((getattr(c, n) for n in names if getattr(c, n, None) is not None), default)
    layers = get("num_hidden_layers", "n_layer")
    hidden = get("hidden_size", "n_embd")
    heads = get("num_attention_heads", "n_head")
    if not all(isinstance(x, int) for x in (layers, hidden, heads)):
        return None
    act_name = str(get("hidden_act", "activation_function", default="gelu"))
    rms = get("rms_norm_eps") is not None
    rope = (
        get("rope_theta") is not None or get("rope_parameters", "rope_scaling") is not None or c.model_type in ("llama", "mistral", "mixtral", "qwen2", "qwen3")
    )
    ffn = get("intermediate_size", "n_inner", default=4 * hidden)
    arch = {
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": get("num_key_value_heads", default=heads),
        "ffn_hidden_size": ffn,
        "seq_length": seq_len,
        "max_position_embeddings": get("max_position_embeddings", "n_positions", default=seq_len),
        "vocab_size": get("vocab_size"),
        "normalization": "RMSNorm" if rms else "LayerNorm",
        "activation": hf_activation(c.model_type, act_name),
        "position_embedding": "rope" if rope else "learned_absolute",
        "tied_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "bias": bool(get("attention_bias", "mlp_bias", default=c.model_type in ("gpt2",))),
        # Qwen2's attention builds q, k and v with biases and the output projection without (no config field says so)
        "qkv_bias": c.model_type in QKV_BIAS_TYPES and not get("attention_bias", "mlp_bias", default=False),
        "dropout": float(get("attention_dropout", "attn_pdrop", default=0.0) or 0.0),
    }
    eps = get("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_epsilon")
    if isinstance(eps, (int, float)):
        arch["norm_epsilon"] = float(eps)
    if rope:
        arch.update(_hf_rope(c))
    if get("head_dim") is not None and not mla:
        arch["kv_channels"] = get("head_dim")
    if c.model_type in ("qwen3", "qwen3_moe"):
        arch["qk_layernorm"] = True  # q_norm / k_norm: RMSNorm over each head
    if mla:
        arch["num_query_groups"] = None
        # DeepseekV3Attention's q_a_layernorm / kv_a_layernorm: Megatron's MLA builds its latent norms only with
        # --qk-layernorm (gpt_layer_specs.py, core_v0.16.1)
        arch["qk_layernorm"] = True
    arch.update({k: v for k, v in moe.items() if k != "dense"})
    return arch


#: Llama 3.x scaling constants Megatron-LM's RotaryEmbedding._apply_scaling fixes (core_v0.16.1); only the factor is a flag
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _hf_rope(c: Any) -> dict[str, Any]:
    """rotary_base, rotary_percent, rope_scaling and its factor from a transformers config's rope parameters.

    transformers 5 keeps them in ``rope_parameters`` (``rope_type``, ``rope_theta``, the scaling fields; older configs'
    ``rope_scaling`` / ``rope_theta`` are folded into it); ``partial_rotary_factor`` rotates part of each head. Llama 3.x
    scaling with constants Megatron does not fix, and every other rope type, are kept by name so that
    :func:`planner.engines.megatron.architecture.rope_problems` says why Megatron cannot run them."""
    params = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return {}
    if params and all(isinstance(v, dict) for v in params.values()):  # one rope per attention kind (Gemma 3)
        return {"rope_scaling": "one rope per attention type (" + ", ".join(sorted(params)) + ")"}
    out: dict[str, Any] = {}
    theta = params.get("rope_theta", getattr(c, "rope_theta", None))
    if isinstance(theta, (int, float)):
        out["rotary_base"] = int(theta) if float(theta).is_integer() else float(theta)
    partial = params.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None))
    if isinstance(partial, (int, float)) and float(partial) != 1.0:
        out["rotary_percent"] = float(partial)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return out
    out["rope_scaling_factor"] = params.get("factor")
    off = {k: params.get(k) for k, v in _MEGATRON_LLAMA3_ROPE.items() if kind == "llama3" and params.get(k) != v}
    out["rope_scaling"] = kind if not off else "llama3 with " + ", ".join(f"{k} {v}" for k, v in off.items())
    return out


def _moe_pattern(c: Any) -> list[int]:
    """One 0/1 entry per layer (1: sparse MoE block), as each model's decoder layer decides."""
    L = c.num_hidden_layers
    if c.model_type == "deepseek_v3":  # DeepseekV3DecoderLayer: MoE from layer first_k_dense_replace on
        return [int(i >= c.first_k_dense_replace) for i in range(L)]
    if c.model_type in ("qwen2_moe", "qwen3_moe"):  # Qwen2/3MoeDecoderLayer
        only = set(getattr(c, "mlp_only_layers", None) or [])
        return [int(i not in only and (i + 1) % c.decoder_sparse_step == 0) for i in range(L)]
    return [1] * L  # Mixtral: every layer


def hf_moe_architecture(c: Any) -> dict[str, Any] | None:
    """The MoE (and multi-latent attention) keys of architecture() for a transformers MoE config; {"dense": True} for a
    dense one; None for a mixture of experts Megatron's MoE layer does not run as the model does.

    Read from transformers 5's models (routing as each ``*TopkRouter`` / ``*SparseMoeBlock`` computes it):
    Mixtral (softmax, top-k renormalized: Megatron's default), Qwen2-MoE / Qwen3-MoE (softmax; ``norm_topk_prob``
    False means no renormalization: ``--moe-router-pre-softmax``; Qwen2-MoE's one shared expert behind a sigmoid gate:
    ``--moe-shared-expert-gate``), DeepSeek-V3 (sigmoid scores, ``e_score_correction_bias``: the expert bias,
    normalized top-k x ``routed_scaling_factor``, ``n_group``/``topk_group`` group-limited routing, which Megatron ranks
    by the top-(k / topk_group) scores of each group and transformers by the top 2, so only k / topk_group = 2 maps).
    The balancing loss counts only with ``output_router_logits`` (the models add it to the loss only then).
    """
    kind = c.model_type
    experts = getattr(c, {"mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts"}.get(kind, "num_experts"), None)
    if not any(getattr(c, k, None) for k in ("num_local_experts", "num_experts", "n_routed_experts")):
        return {"dense": True}
    if kind not in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3") or not isinstance(experts, int):
        return None
    topk = c.num_experts_per_tok
    out: dict[str, Any] = {
        "num_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": c.intermediate_size if kind == "mixtral" else c.moe_intermediate_size,
        "moe_layer_freq": _moe_pattern(c),
    }
    if getattr(c, "output_router_logits", False):
        out |= {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": float(c.router_aux_loss_coef)}
    else:
        out["moe_router_load_balancing_type"] = "none"
    if kind in ("qwen2_moe", "qwen3_moe") and not c.norm_topk_prob:
        out["moe_router_pre_softmax"] = True
    if kind == "qwen2_moe" and c.shared_expert_intermediate_size:
        out |= {"moe_shared_expert_intermediate_size": c.shared_expert_intermediate_size, "moe_shared_expert_gate": True}
    if kind == "deepseek_v3":
        if not c.norm_topk_prob and topk > 1:
            return None  # Megatron normalizes sigmoid top-k scores whenever k > 1
        groups, group_topk = c.n_group or 1, c.topk_group or 1
        if groups > 1:
            if topk // group_topk != 2 or experts % groups:
                return None
            out |= {"moe_router_num_groups": groups, "moe_router_group_topk": group_topk}
        out |= {
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "moe_router_topk_scaling_factor": float(c.routed_scaling_factor) if c.routed_scaling_factor != 1.0 else None,
            "moe_shared_expert_intermediate_size": c.n_shared_experts * c.moe_intermediate_size if c.n_shared_experts else None,
            "multi_latent_attention": True,
            "q_lora_rank": c.q_lora_rank,
            "kv_lora_rank": c.kv_lora_rank,
            "qk_head_dim": c.qk_nope_head_dim,  # Megatron's qk_head_dim excludes the rotary part (transformers' includes it)
            "qk_pos_emb_head_dim": c.qk_rope_head_dim,
            "v_head_dim": c.v_head_dim,
        }
    return {k: v for k, v in out.items() if v is not None}
