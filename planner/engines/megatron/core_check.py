"""Megatron-LM flags as megatron-core sees them: the TransformerConfig Megatron-LM would build, and its per-stage layer counts.

megatron-core is optional (the test extra installs it); importing this module does not import it.
"""

from __future__ import annotations

from planner.engines.megatron.architecture import MegatronArgs, parse_layout


def core_config(args: MegatronArgs):
    """TransformerConfig built from the flags the way Megatron-LM's core_transformer_config_from_args does."""
    import torch
    from megatron.core.activations import squared_relu
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    def i(name, default=None):
        return args.int(name, default)

    pp = i("--pipeline-model-parallel-size", 1)
    tp = i("--tensor-model-parallel-size", 1)
    layout = args.value("--pipeline-model-parallel-layout")
    vp = None
    if layout is not None:
        vp = len(parse_layout(layout)) // pp
    elif args.has("--num-virtual-stages-per-pipeline-rank"):
        vp = i("--num-virtual-stages-per-pipeline-rank")
    vp = vp if vp and vp > 1 else None
    dtype = torch.bfloat16 if args.has("--bf16") else torch.half if args.has("--fp16") else torch.float32
    swiglu = args.has("--swiglu")
    bias = not args.has("--disable-bias-linear")
    # core_transformer_config_from_args: bias_swiglu_fusion with --swiglu, else bias_gelu_fusion, which validate_args turns
    # off without biases; --squared-relu only swaps the function (TransformerConfig then refuses a fusion it cannot do)
    fusion = not args.has("--no-bias-swiglu-fusion") if swiglu else bias and not args.has("--no-bias-gelu-fusion")
    activation = squared_relu if args.has("--squared-relu") else torch.nn.functional.silu if swiglu else torch.nn.functional.gelu
    gran = "selective" if args.has("--recompute-activations") else args.value("--recompute-granularity")
    config_class = MLATransformerConfig if args.has("--multi-latent-attention") else TransformerConfig
    return config_class(
        **moe_kwargs(args, tp),
        num_layers=i("--num-layers"),
        hidden_size=i("--hidden-size"),
        num_attention_heads=i("--num-attention-heads"),
        num_query_groups=i("--num-query-groups") if args.has("--group-query-attention") else None,
        ffn_hidden_size=i("--ffn-hidden-size"),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=i("--context-parallel-size", 1),
        cp_comm_type=args.value("--cp-comm-type") or "p2p",  # arguments.py: one value is every layer's (default p2p)
        virtual_pipeline_model_parallel_size=vp,
        pipeline_model_parallel_layout=layout,
        num_layers_in_first_pipeline_stage=i("--decoder-first-pipeline-num-layers"),
        num_layers_in_last_pipeline_stage=i("--decoder-last-pipeline-num-layers"),
        account_for_embedding_in_pipeline_split=args.has("--account-for-embedding-in-pipeline-split"),
        account_for_loss_in_pipeline_split=args.has("--account-for-loss-in-pipeline-split"),
        sequence_parallel=args.has("--sequence-parallel") and tp > 1,  # validate_args drops it at tp = 1
        bf16=args.has("--bf16"),
        fp16=args.has("--fp16"),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        recompute_granularity=gran,
        recompute_method=args.value("--recompute-method"),
        recompute_num_layers=i("--recompute-num-layers"),
        recompute_modules=list(args.get("--recompute-modules").values) if args.has("--recompute-modules") else None,
        normalization=args.value("--normalization") or "LayerNorm",
        gated_linear_unit=swiglu,
        activation_func=activation,
        add_bias_linear=bias,
        add_qkv_bias=bias or args.has("--add-qkv-bias"),  # validate_args keeps add_qkv_bias in sync with add_bias_linear
        bias_activation_fusion=fusion,
        attention_dropout=float(args.value("--attention-dropout") or 0.1),
        hidden_dropout=float(args.value("--hidden-dropout") or 0.1),
        # Megatron-LM fuses rope unless --no-rope-fusion or the position embedding is not rope (validate_args); the fused
        # kernel needs Transformer Engine, absent on this CPU machine, except for MLA, whose config only checks the rope type
        apply_rope_fusion=args.has("--multi-latent-attention")
        and (args.value("--position-embedding-type") or "learned_absolute") == "rope"
        and not args.has("--no-rope-fusion"),
        batch_p2p_comm=not (vp and not args.has("--no-overlap-p2p-communication")),
    )


def moe_kwargs(args: MegatronArgs, tp: int) -> dict:
    """The MoE, expert-parallel and attention-variant fields of the config, as core_transformer_config_from_args and
    validate_args (Megatron-LM core_v0.16.1 arguments.py) set them; none for a dense model with plain attention."""
    from planner.engines.megatron.moe import parse_layer_freq

    out: dict = {}
    if args.has("--kv-channels"):
        out["kv_channels"] = args.int("--kv-channels")
    if args.has("--qk-layernorm"):
        out["qk_layernorm"] = True
    if args.has("--multi-latent-attention"):
        out["multi_latent_attention"] = True
        out["q_lora_rank"] = args.int("--q-lora-rank")  # arguments.py default None
        for flag, default in (("--kv-lora-rank", 32), ("--qk-head-dim", 128), ("--qk-pos-emb-head-dim", 64), ("--v-head-dim", 128)):
            out[flag[2:].replace("-", "_")] = args.int(flag, default)
        if args.has("--rope-type"):
            out["rope_type"] = args.value("--rope-type")
    experts = args.int("--num-experts")
    ep = args.int("--expert-model-parallel-size", 1)
    if experts or (ep or 1) > 1:
        out["expert_model_parallel_size"] = ep
        out["expert_tensor_parallel_size"] = args.int("--expert-tensor-parallel-size", tp)
    if args.has("--overlap-moe-expert-parallel-comm"):  # a ModelParallelConfig field; TransformerConfig checks it
        out["overlap_moe_expert_parallel_comm"] = True
    if not experts:
        return out
    balance = args.get("--moe-router-load-balancing-type")
    coeff = args.get("--moe-aux-loss-coeff")
    out |= {
        "num_moe_experts": experts,
        "moe_router_topk": args.int("--moe-router-topk", 2),
        "moe_ffn_hidden_size": args.int("--moe-ffn-hidden-size") or args.int("--ffn-hidden-size"),
        "moe_shared_expert_intermediate_size": args.int("--moe-shared-expert-intermediate-size"),
        "moe_layer_freq": parse_layer_freq(args.value("--moe-layer-freq") or "1"),
        "moe_router_score_function": args.value("--moe-router-score-function") or "softmax",
        "moe_router_pre_softmax": args.has("--moe-router-pre-softmax"),
        "moe_router_enable_expert_bias": args.has("--moe-router-enable-expert-bias"),
        "moe_router_topk_scaling_factor": float(args.value("--moe-router-topk-scaling-factor") or 0) or None,
        # validate_args unwraps one-element lists
        "moe_router_load_balancing_type": (balance.values[0] if len(balance.values) == 1 else list(balance.values)) if balance else "aux_loss",
        "moe_aux_loss_coeff": (float(coeff.values[0]) if len(coeff.values) == 1 else [float(v) for v in coeff.values]) if coeff else 0.0,
        "moe_grouped_gemm": args.has("--moe-grouped-gemm"),
        "moe_token_dispatcher_type": args.value("--moe-token-dispatcher-type") or "allgather",
        "moe_shared_expert_overlap": args.has("--moe-shared-expert-overlap"),
        "moe_shared_expert_gate": args.has("--moe-shared-expert-gate"),
        "moe_router_num_groups": args.int("--moe-router-num-groups"),
        "moe_router_group_topk": args.int("--moe-router-group-topk"),
    }
    return out


def core_stage_layers(config) -> list[int]:
    """Decoder layers per stage as megatron-core's get_num_layers_to_build computes them."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    pp = config.pipeline_model_parallel_size
    vp = config.virtual_pipeline_model_parallel_size
    out = []
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vp)
    try:
        for c in range(vp or 1):
            for r in range(pp):
                parallel_state.set_pipeline_model_parallel_rank(r)
                out.append(get_num_layers_to_build(config, vp_stage=c if vp else None, pp_rank=r))
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
        parallel_state.set_pipeline_model_parallel_rank(None)
    return out


def transformer_config_check(args: MegatronArgs) -> tuple[bool, str]:
    """Whether megatron-core accepts the flags: (ok, what it said). (False, reason) when megatron-core is not installed."""
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return False, "megatron-core is not installed (pip install megatron-core==0.16.1) so the flags could not be checked by it"
    try:
        cfg = core_config(args)
        layers = core_stage_layers(cfg)
    except (ValueError, AssertionError, TypeError) as e:
        return False, f"TransformerConfig refused the flags: {e}"
    return True, f"TransformerConfig accepted them; layers per (virtual) stage {layers}"
