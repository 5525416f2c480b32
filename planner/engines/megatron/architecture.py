"""Megatron-LM for the planner: the model file's ``architecture()`` mapped onto Megatron's GPT model, and the public names of the Megatron rules.

* :data:`ARCHITECTURE` lists every ``architecture()`` key with its default (README.md's table is
  checked against it); :func:`architecture_defaults` fills the optional ones;
  :func:`architecture_problem` says why an architecture does not map onto Megatron-LM's GPT
  model; :func:`tensor_parallel_problems` is the search's view of the tp rules (MEG013/014/030).
* The flags themselves live in planner.engines.megatron.flags (records, argparse grouping),
  planner.engines.megatron.layout (layer splits) and planner.engines.megatron.arg_rules (MEG rules); their public
  names are re-exported here. Launch scripts are run (with stub launchers) by
  planner.engines.megatron.script, never interpreted.

Sources: Megatron-LM at tag core_v0.16.1 (megatron/training/arguments.py) and megatron-core 0.16.1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

from planner.engines.megatron.arg_rules import REQUIRED_FLAGS, RULES, Finding, check_megatron_args, errors
from planner.engines.megatron.flags import (
    MEGATRON_VERSION,
    MODELLED_RECOMPUTE_MODULES,
    RECOMPUTE_MODULES,
    EnvVar,
    Flag,
    FlagSpec,
    MegatronArgs,
    as_int,
    flag_parser,
    flag_table,
    group_argv,
    parse_args_file,
)
from planner.engines.megatron.layout import LayoutError, layout_string, parse_layout, split_flags, stage_layers, virtual_size
from planner.engines.megatron.moe import MOE_DEFAULTS, mla_problems, moe_problems

__all__ = [
    "ACTIVATIONS",
    "ARCHITECTURE",
    "ARCHITECTURE_KEYS",
    "MEGATRON_VERSION",
    "NORMALIZATIONS",
    "MODELLED_RECOMPUTE_MODULES",
    "POSITION_EMBEDDINGS",
    "RECOMPUTE_MODULES",
    "REQUIRED_FLAGS",
    "RULES",
    "ArchKey",
    "EnvVar",
    "Finding",
    "Flag",
    "FlagSpec",
    "LayoutError",
    "MegatronArgs",
    "architecture_defaults",
    "architecture_problem",
    "as_int",
    "check_megatron_args",
    "errors",
    "flag_parser",
    "flag_table",
    "group_argv",
    "layout_string",
    "megatron_ffn_hidden_size",
    "parse_args_file",
    "parse_layout",
    "recompute_module_problems",
    "rope_problems",
    "split_flags",
    "stage_layers",
    "tensor_parallel_problems",
    "virtual_size",
]

#: MLP activations of Megatron-LM core_v0.16.1 the planner prices: gelu (default), --swiglu, --squared-relu
ACTIVATIONS = ("gelu", "swiglu", "squared_relu")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
#: --position-embedding-type choices of Megatron-LM core_v0.16.1 (arguments.py, _add_network_size_args)
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "mrope", "relative", "none")
REQUIRED = object()


@dataclass(frozen=True)
class ArchKey:
    """One ``architecture()`` key: its default (:data:`REQUIRED` when it has none) and what Megatron makes of it."""

    name: str
    default: Any
    meaning: str


#: every key architecture() may return, in README order
ARCHITECTURE: tuple[ArchKey, ...] = (
    ArchKey("num_layers", REQUIRED, "transformer layers (`--num-layers`)"),
    ArchKey("hidden_size", REQUIRED, "model width (`--hidden-size`)"),
    ArchKey("num_attention_heads", REQUIRED, "query heads (`--num-attention-heads`)"),
    ArchKey("seq_length", REQUIRED, "tokens per sample (`--seq-length`); also the costing sequence length"),
    ArchKey("max_position_embeddings", REQUIRED, "position table size, at least seq_length (`--max-position-embeddings`)"),
    ArchKey("vocab_size", REQUIRED, "embedding rows (`--vocab-size` for NullTokenizer, minus its end-of-document id)"),
    ArchKey("normalization", REQUIRED, "`LayerNorm` or `RMSNorm` (`--normalization`)"),
    ArchKey("activation", REQUIRED, "`gelu`, `swiglu` (`--swiglu`) or `squared_relu` (`--squared-relu`)"),
    ArchKey("position_embedding", REQUIRED, "one of " + ", ".join(f"`{p}`" for p in POSITION_EMBEDDINGS) + " (`--position-embedding-type`)"),
    ArchKey("num_query_groups", None, "key/value heads; unset or equal to the heads means multi-head attention (`--group-query-attention --num-query-groups`)"),
    ArchKey(
        "ffn_hidden_size", None, "MLP width; unset means Megatron's: 4 x hidden_size, or int(8 x hidden_size / 3 / 64) x 64 with swiglu (`--ffn-hidden-size`)"
    ),
    ArchKey("tied_embeddings", True, "input embedding shared with the output layer (else `--untie-embeddings-and-output-weights`)"),
    ArchKey("bias", True, "biases in the linear layers (else `--disable-bias-linear`)"),
    ArchKey("qkv_bias", False, "without `bias`, biases in the query, key and value projections only, as Qwen2's (`--add-qkv-bias`)"),
    ArchKey("dropout", 0.0, "attention and hidden dropout probability (`--attention-dropout`, `--hidden-dropout`)"),
    ArchKey("norm_epsilon", None, "normalization epsilon; unset means Megatron's 1e-5 (`--norm-epsilon`)"),
    ArchKey("rotary_base", None, "RoPE base for rope/mrope, an integer; unset means Megatron's 10000 (`--rotary-base`)"),
    ArchKey("rotary_percent", 1.0, "fraction of each head's width that is rotated, in (0, 1] (`--rotary-percent`)"),
    ArchKey(
        "rope_scaling",
        None,
        "`llama3` (Llama 3.x frequency scaling, `--use-rope-scaling`) or `linear` (positions divided by the factor, "
        "`--rotary-seq-len-interpolation-factor`); unset means none",
    ),
    ArchKey("rope_scaling_factor", None, "the factor of rope_scaling, required with it (`--rope-scaling-factor`; an integer above 1 for linear)"),
    ArchKey("mrope_section", None, "list of ints, required with position_embedding `mrope` (`--mrope-section`)"),
    ArchKey("kv_channels", None, "width of each attention head; unset means hidden_size / heads (`--kv-channels`, written when it differs)"),
    ArchKey("qk_layernorm", False, "normalize each head's queries and keys, or with MLA the q and kv latents (`--qk-layernorm`)"),
    # multi-latent attention (DeepSeek-V2/V3): megatron-core's MLATransformerConfig
    ArchKey("multi_latent_attention", False, "multi-latent attention; excludes num_query_groups and needs rope (`--multi-latent-attention`)"),
    ArchKey("q_lora_rank", None, "low-rank width of the query projection; unset means a full-rank query (`--q-lora-rank`)"),
    ArchKey("kv_lora_rank", None, "low-rank width of the key/value projection, required with MLA (`--kv-lora-rank`)"),
    ArchKey("qk_head_dim", None, "query/key head width without its rotary part, required with MLA (`--qk-head-dim`)"),
    ArchKey("qk_pos_emb_head_dim", None, "rotary part of the query/key head, required with MLA (`--qk-pos-emb-head-dim`)"),
    ArchKey("v_head_dim", None, "value head width, required with MLA (`--v-head-dim`)"),
    # mixtures of experts: megatron-core's MoELayer (dropless, grouped GEMM, all-to-all token dispatch)
    ArchKey("num_experts", None, "routed experts per MoE layer; unset means a dense model (`--num-experts`)"),
    ArchKey("moe_router_topk", None, "experts each token is routed to, 1 ... num_experts, required with num_experts (`--moe-router-topk`)"),
    ArchKey("moe_ffn_hidden_size", None, "each routed expert's MLP width; unset means ffn_hidden_size (`--moe-ffn-hidden-size`)"),
    ArchKey(
        "moe_shared_expert_intermediate_size",
        None,
        "shared experts' total MLP width (count x width); unset means none (`--moe-shared-expert-intermediate-size`)",
    ),
    ArchKey(
        "moe_shared_expert_gate",
        MOE_DEFAULTS["moe_shared_expert_gate"],
        "a sigmoid gate on the shared experts' output, as Qwen2-MoE's (`--moe-shared-expert-gate`)",
    ),
    ArchKey(
        "moe_layer_freq",
        MOE_DEFAULTS["moe_layer_freq"],
        "which layers are MoE: N (layers 0, N, 2N, ...) or a 0/1 list, one per layer (`--moe-layer-freq`, its shortest exact form)",
    ),
    ArchKey("moe_router_score_function", MOE_DEFAULTS["moe_router_score_function"], "`softmax` or `sigmoid` (`--moe-router-score-function`)"),
    ArchKey(
        "moe_router_pre_softmax",
        MOE_DEFAULTS["moe_router_pre_softmax"],
        "softmax over all experts before the top-k, no renormalization (`--moe-router-pre-softmax`)",
    ),
    ArchKey(
        "moe_router_enable_expert_bias",
        MOE_DEFAULTS["moe_router_enable_expert_bias"],
        "aux-loss-free balancing bias on the routing scores, sigmoid only (`--moe-router-enable-expert-bias`)",
    ),
    ArchKey("moe_router_num_groups", None, "expert groups for group-limited routing (DeepSeek-V3's n_group); unset means none (`--moe-router-num-groups`)"),
    ArchKey("moe_router_group_topk", None, "groups each token's experts come from, with moe_router_num_groups (`--moe-router-group-topk`)"),
    ArchKey("moe_router_topk_scaling_factor", None, "factor on the routed experts' weights; unset means 1 (`--moe-router-topk-scaling-factor`)"),
    ArchKey(
        "moe_router_load_balancing_type",
        MOE_DEFAULTS["moe_router_load_balancing_type"],
        "`aux_loss`, `seq_aux_loss`, `global_aux_loss`, `sinkhorn` or `none` (`--moe-router-load-balancing-type`)",
    ),
    ArchKey(
        "moe_aux_loss_coeff", MOE_DEFAULTS["moe_aux_loss_coeff"], "weight of the balancing loss (`--moe-aux-loss-coeff`, written unless the type is `none`)"
    ),
)
#: the keys Megatron cannot do without
ARCHITECTURE_KEYS = tuple(k.name for k in ARCHITECTURE if k.default is REQUIRED)


def megatron_ffn_hidden_size(hidden: int, swiglu: bool) -> int:
    """The FFN width validate_args picks when --ffn-hidden-size is not given."""
    return int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden


def recompute_module_problems(modules: tuple[str, ...], arch: dict[str, Any] | None) -> list[str]:
    """Why ``--recompute-modules`` ``modules`` cannot be planned for ``arch``: names Megatron does not know, modules the
    planner does not model, repeats, and TransformerConfig's own rule (mla_up_proj needs multi-latent attention)."""
    out = []
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown:
        out.append(f"Megatron has no recompute module {', '.join(unknown)} (choices: {', '.join(RECOMPUTE_MODULES)})")
    unmodelled = [m for m in modules if m in RECOMPUTE_MODULES and m not in MODELLED_RECOMPUTE_MODULES]
    if unmodelled:
        out.append(f"the planner does not model recomputing {', '.join(unmodelled)} (modelled: {', '.join(MODELLED_RECOMPUTE_MODULES)})")
    if len(set(modules)) != len(modules):
        out.append("a recompute module is named twice")
    if "mla_up_proj" in modules and not (arch or {}).get("multi_latent_attention"):
        out.append("mla_up_proj recomputation needs multi-latent attention (TransformerConfig: mla_up_proj needs multi_latent_attention)")
    return out


def architecture_defaults(arch: dict[str, Any]) -> dict[str, Any]:
    """``arch`` with every optional key of :data:`ARCHITECTURE` present (its default where absent or None); other keys kept."""
    out = dict(arch)
    for k in ARCHITECTURE:
        if k.default is not REQUIRED and out.get(k.name) is None:
            out[k.name] = k.default
    return out


def architecture_problem(arch: dict[str, Any] | None, model: str = "the model file") -> tuple[str, str] | None:
    """Why a model file's ``architecture()`` dict does not map onto Megatron-LM's GPT model, as (message, hint); None when it does.

    Megatron builds its own model from flags: it needs the shape (ARCHITECTURE_KEYS), a gelu, swiglu or squared-ReLU
    MLP, LayerNorm or RMSNorm, a position embedding Megatron accepts, heads dividing into the query groups.
    The search can call this before planning ``--engine megatron``; the renderer raises it as a UsageError.
    """
    if not arch:
        return (
            f"{model} defines no architecture(): Megatron-LM builds its own GPT model from flags and needs the shape "
            "(layers, hidden size, heads, FFN size, vocabulary, norm, activation, position embedding).",
            "Add architecture(**kwargs) -> dict to the model file (see examples/llama.py and README.md's architecture() table), "
            "or plan with --engine deepspeed or torch.",
        )
    missing = [k for k in ARCHITECTURE_KEYS if arch.get(k) is None]
    if missing:
        return (
            f"{model}'s architecture() lacks {', '.join(missing)}; Megatron-LM needs them.",
            "Add the missing keys to architecture() (README.md lists every key).",
        )
    arch = architecture_defaults(arch)
    problems = []
    for key, allowed in (("activation", ACTIVATIONS), ("normalization", NORMALIZATIONS), ("position_embedding", POSITION_EMBEDDINGS)):
        if arch[key] not in allowed:
            problems.append(f"{key.replace('_', ' ')} {arch[key]!r} (Megatron's GPT model here takes {', '.join(allowed)})")
    for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings", "vocab_size"):
        if not isinstance(arch[key], int) or isinstance(arch[key], bool) or arch[key] < 1:
            problems.append(f"{key} = {arch[key]!r} (a positive integer is needed)")
    heads = arch["num_attention_heads"]
    groups = arch["num_query_groups"] or heads
    if isinstance(groups, int) and isinstance(heads, int) and groups > 0 and heads % groups:
        problems.append(f"{heads} attention heads in {groups} query groups (the heads must divide into the groups)")
    dropout = arch["dropout"]
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0.0 <= float(dropout) < 1.0:
        problems.append(f"dropout {dropout!r} (a probability in [0, 1) is needed)")
    for key in ("tied_embeddings", "bias"):
        if not isinstance(arch[key], bool):
            problems.append(f"{key} = {arch[key]!r} (True or False)")
    section = arch["mrope_section"]
    if arch["position_embedding"] == "mrope" and (
        not isinstance(section, (list, tuple)) or not section or not all(isinstance(x, int) and x > 0 for x in section)
    ):
        problems.append(f"position embedding 'mrope' with mrope_section {section!r} (validate_args asserts a list of positive ints)")
    kv = arch["kv_channels"]
    if kv is not None and (not isinstance(kv, int) or isinstance(kv, bool) or kv < 1):
        problems.append(f"kv_channels = {kv!r} (a positive integer or unset)")
    if not isinstance(arch["qkv_bias"], bool):
        problems.append(f"qkv_bias = {arch['qkv_bias']!r} (True or False)")
    if not isinstance(arch["qk_layernorm"], bool):
        problems.append(f"qk_layernorm = {arch['qk_layernorm']!r} (True or False)")
    problems += rope_problems(arch)
    problems += mla_problems(arch) + moe_problems(arch)
    if problems:
        return (
            f"{model}'s architecture does not map onto Megatron-LM's GPT model: " + "; ".join(problems) + ".",
            "Fix architecture() (README.md lists every key), or plan with --engine deepspeed or torch, which run the model file itself.",
        )
    return None


#: the rope_scaling kinds Megatron-LM's GPT model runs (RotaryEmbedding, core_v0.16.1): Llama 3.x scaling with its
#: fixed constants (``_apply_scaling``: low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192)
#: and linear position interpolation (``seq_len_interpolation_factor``)
ROPE_SCALINGS = ("llama3", "linear")


def _number(x: Any) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def rope_problems(arch: dict[str, Any]) -> list[str]:
    """Why the rotary embedding of a defaults-filled ``arch`` is not one Megatron-LM's GPT model builds; empty when it is.

    ``--rotary-base`` and ``--rotary-seq-len-interpolation-factor`` are ``type=int`` (arguments.py); RotaryEmbedding
    rotates ``int(kv_channels x rotary_percent)`` channels and applies Llama 3.x scaling or linear interpolation only.
    """
    out: list[str] = []
    base, percent = arch.get("rotary_base"), arch.get("rotary_percent", 1.0)
    scaling, factor = arch.get("rope_scaling"), arch.get("rope_scaling_factor")
    if base is not None and (not _number(base) or base <= 0 or float(base) != int(base)):
        out.append(f"rotary_base = {base!r} (--rotary-base takes a positive integer)")
    if not _number(percent) or not 0.0 < float(percent) <= 1.0:
        out.append(f"rotary_percent = {percent!r} (a fraction in (0, 1] is needed)")
    if scaling is None:
        return out
    if scaling not in ROPE_SCALINGS:
        out.append(
            f"rope scaling {scaling!r} (Megatron's GPT model runs Llama 3.x scaling with low/high frequency factors 1 and 4 "
            "over 8192 original positions, or linear interpolation by an integer factor)"
        )
    elif arch.get("position_embedding") not in ("rope", "mrope") or arch.get("multi_latent_attention"):
        out.append(f"rope scaling {scaling!r} without plain rope (it applies to --position-embedding-type rope)")
    elif not _number(factor) or factor <= 0 or (scaling == "linear" and (float(factor) != int(factor) or factor <= 1)):
        need = "an integer above 1" if scaling == "linear" else "a positive number"
        out.append(f"rope_scaling_factor = {factor!r} with {scaling} scaling ({need} is needed)")
    return out


def tensor_parallel_problems(arch: dict[str, Any], tp: int) -> list[str]:
    """Why Megatron cannot split this architecture over ``tp`` GPUs (the MEG013, MEG014, MEG030 rules); empty when it can.

    For the search: heads divisible by tp; query groups a multiple or a divisor of tp
    (TransformerConfig); FFN hidden size divisible by tp (the MLP's parallel linear layers).
    """
    out = []
    heads = arch.get("num_attention_heads") or 0
    groups = arch.get("num_query_groups") or heads
    ffn = arch.get("ffn_hidden_size")
    if heads and heads % tp:
        out.append(f"{heads} attention heads are not divisible by tp = {tp}")
    if groups and groups % tp and tp % groups:
        out.append(f"{groups} query groups are neither a multiple nor a divisor of tp = {tp}")
    if ffn and ffn % tp:
        out.append(f"FFN hidden size {ffn} is not divisible by tp = {tp}")
    return out
