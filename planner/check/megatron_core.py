"""Megatron-LM flags as megatron-core sees them: the TransformerConfig Megatron-LM would build, and its per-stage layer counts.

megatron-core is optional (the test extra installs it); importing this module does not import it.
"""

from __future__ import annotations

from planner.megatron_args import MegatronArgs, parse_layout


def core_config(args: MegatronArgs):
    """TransformerConfig built from the flags the way Megatron-LM's core_transformer_config_from_args does."""
    import torch
    from megatron.core.transformer import TransformerConfig

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
    gran = "selective" if args.has("--recompute-activations") else args.value("--recompute-granularity")
    return TransformerConfig(
        num_layers=i("--num-layers"),
        hidden_size=i("--hidden-size"),
        num_attention_heads=i("--num-attention-heads"),
        num_query_groups=i("--num-query-groups") if args.has("--group-query-attention") else None,
        ffn_hidden_size=i("--ffn-hidden-size"),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=i("--context-parallel-size", 1),
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
        normalization=args.value("--normalization") or "LayerNorm",
        gated_linear_unit=swiglu,
        activation_func=torch.nn.functional.silu if swiglu else torch.nn.functional.gelu,
        add_bias_linear=bias,
        bias_activation_fusion=bias or swiglu,  # validate_args turns bias_gelu_fusion off without biases
        attention_dropout=float(args.value("--attention-dropout") or 0.1),
        hidden_dropout=float(args.value("--hidden-dropout") or 0.1),
        apply_rope_fusion=False,  # Megatron-LM's default needs Transformer Engine, absent on this CPU machine
        batch_p2p_comm=not (vp and not args.has("--no-overlap-p2p-communication")),
    )


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
