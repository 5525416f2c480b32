"""Render a plan for Megatron-LM's ``pretrain_gpt.py``: pretrain_gpt.sh, launch_slurm.sh, README.md.

Megatron builds its own GPT model from flags, so the model file's
``architecture()`` (plan.model["architecture"]) is mapped onto them:
RMSNorm -> ``--normalization RMSNorm``, swiglu -> ``--swiglu``, squared_relu -> ``--squared-relu``, rope ->
``--position-embedding-type rope``, fewer key/value heads than query heads ->
``--group-query-attention --num-query-groups``, untied head ->
``--untie-embeddings-and-output-weights``, no biases -> ``--disable-bias-linear`` (q/k/v biases
only: ``--add-qkv-bias``).
The planned split (whole transformer layers per stage, counted from
plan.model["blocks"]) becomes an even split, ``--decoder-first/last-pipeline-num-layers``
or ``--pipeline-model-parallel-layout`` (:func:`planner.engines.megatron.architecture.split_flags`).

pretrain_gpt.sh follows Megatron's own convention (examples/gpt3/train_gpt3_175b_distributed.sh):
a bash script with DISTRIBUTED_ARGS / GPT_MODEL_ARGS / TRAINING_ARGS /
MODEL_PARALLEL_ARGS / DATA_ARGS / EVAL_AND_LOGGING_ARGS arrays that runs
torchrun itself. The flags are data (:func:`flag_groups`, a list of (flag, value) per array):
the template writes them and :func:`planner.engines.megatron.architecture.check_megatron_args` checks the same
list (:func:`rendered_args`) before anything is returned: a plan Megatron would refuse is a
UsageError here, not minutes into a job. Nothing is parsed back from the bash.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from planner.engines.base import repeated_layers
from planner.engines.megatron.architecture import (
    MEGATRON_VERSION,
    EnvVar,
    Flag,
    MegatronArgs,
    architecture_defaults,
    architecture_problem,
    check_megatron_args,
    errors,
    split_flags,
    stage_layers,
)
from planner.engines.megatron.moe import layer_freq_text, layer_pattern
from planner.engines.megatron.rules import precision_aware
from planner.errors import UsageError
from planner.launch import cluster_shape, job_name
from planner.solve.plan import Plan
from planner.templating import one_line, render_template

SCRIPT = "pretrain_gpt.sh"
DEFAULT_TRAIN_ITERS = 100
#: optimizer and schedule hyperparameters: user choices the plan does not fix (GPT-3 paper / Megatron examples)
HYPERPARAMETERS: tuple[tuple[str, str], ...] = (
    ("--lr", "1.0e-4"),
    ("--min-lr", "1.0e-5"),
    ("--lr-decay-style", "cosine"),
    ("--lr-warmup-fraction", "0.01"),
    ("--weight-decay", "0.1"),
    ("--adam-beta1", "0.9"),
    ("--adam-beta2", "0.95"),
    ("--init-method-std", "0.02"),
    ("--clip-grad", "1.0"),
)

Flags = list[tuple[str, "str | tuple[str, ...] | None"]]  # a switch, one value, or several (--mrope-section)


# --------------------------------------------------------------------------- the model


def architecture(plan: Plan) -> dict[str, Any]:
    """plan.model["architecture"] with its optional keys defaulted, checked to map onto Megatron's GPT model (UsageError naming what does not)."""
    arch = plan.model.get("architecture")
    problem = architecture_problem(arch, (plan.settings.model.model_file or "the model file"))
    if problem is not None:
        raise UsageError(*problem)
    return architecture_defaults(cast(dict[str, Any], arch))  # architecture_problem answered None: a non-empty dict


def planned_stage_layers(plan: Plan) -> list[int]:
    """Whole transformer layers on each planned stage (plan order), from plan.model["blocks"].

    Raises UsageError when a stage boundary falls inside a transformer layer, when something other
    than the embedding sits before the first layer's stage or after the last one's, or when the block
    count differs from architecture()["num_layers"].
    """
    blocks: Sequence[str | None] = repeated_layers(plan.model.get("blocks") or [])
    pieces: Sequence[str] = plan.model.get("pieces") or []
    if not blocks:
        raise UsageError("plan.json has no model.blocks (which piece belongs to which transformer layer); re-run `planner plan`.")
    names = [b for b in blocks if b is not None]
    order = list(dict.fromkeys(names))
    if not order:
        raise UsageError("the model has no transformer layers the planner recognised (model.blocks is empty); Megatron-LM's GPT model needs them.")
    first = next(i for i, b in enumerate(blocks) if b is not None)
    last = max(i for i, b in enumerate(blocks) if b is not None)
    for i in range(first, last + 1):
        if blocks[i] is None:
            name = pieces[i] if i < len(pieces) else f"piece {i}"
            raise UsageError(
                f"{name!r} sits between transformer layers; Megatron-LM's GPT model has nothing there, so this model does not map onto it.",
                "Plan with --engine deepspeed or torch.",
            )
    seen_runs = [b for k, b in enumerate(names) if k == 0 or names[k - 1] != b]
    if len(seen_runs) != len(order):
        raise UsageError("a transformer layer's pieces are not contiguous in model.blocks; Megatron cannot place it.")
    counts = []
    for s in sorted(plan.stages, key=lambda s: s.index):
        a, b = s.pieces
        if 0 < a < len(blocks) and blocks[a] is not None and blocks[a - 1] == blocks[a]:
            raise UsageError(
                f"stage {s.index} starts at piece {a} ({pieces[a] if a < len(pieces) else a!r}), inside transformer layer {blocks[a]!r}: "
                "Megatron-LM places whole layers only.",
                "Re-plan with --engine megatron (its search cuts between whole layers only), or use --engine deepspeed or torch.",
            )
        if 0 < a < len(blocks) and blocks[a] is None and blocks[a - 1] is None:
            raise UsageError(
                f"stage {s.index} starts at piece {a} ({pieces[a] if a < len(pieces) else a!r}), between two pieces outside the transformer "
                "layers: Megatron-LM keeps the embedding whole on the first stage and the final norm, output layer and loss on the last.",
                "Re-plan with --engine megatron, or use --engine deepspeed or torch.",
            )
        counts.append(len({x for x in blocks[a:b] if x is not None}))
    arch_layers = (plan.model.get("architecture") or {}).get("num_layers")
    if arch_layers is not None and arch_layers != len(order):
        raise UsageError(
            f"architecture() says num_layers = {arch_layers} but the traced model has {len(order)} transformer layers.",
            "Make architecture() describe the model that build_model() returns.",
        )
    if sum(counts) != len(order):
        raise UsageError("the planned stages do not cover every transformer layer exactly once; re-run `planner plan`.")
    return counts


def vocab_flags(vocab: int, tp: int) -> tuple[int, int]:
    """(--vocab-size for NullTokenizer, --make-vocab-size-divisible-by) that give exactly ``vocab`` embedding rows.

    NullTokenizer adds an end-of-document id (vocab_size + 1 tokens) and Megatron pads the
    vocabulary to a multiple of make_vocab_size_divisible_by x tp; the divisor is the largest
    d <= 128 with vocab % (d x tp) == 0, or Megatron's default 128 when tp does not divide vocab.
    """
    if vocab % tp:
        return vocab - 1, 128
    per = vocab // tp
    return vocab - 1, max(d for d in range(1, 129) if per % d == 0)


def padded_vocab(vocab: int, tp: int, divisible_by: int) -> int:
    """Megatron's padded vocabulary (megatron/training/tokenizer/tokenizer.py, _vocab_size_with_padding)."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def model_flags(arch: dict[str, Any]) -> Flags:
    """GPT_MODEL_ARGS for an architecture() dict."""
    heads = arch["num_attention_heads"]
    groups = arch.get("num_query_groups") or heads
    flags: Flags = [
        ("--num-layers", str(arch["num_layers"])),
        ("--hidden-size", str(arch["hidden_size"])),
    ]
    if arch.get("ffn_hidden_size"):
        flags.append(("--ffn-hidden-size", str(arch["ffn_hidden_size"])))
    flags.append(("--num-attention-heads", str(heads)))
    if groups != heads:
        flags += [("--group-query-attention", None), ("--num-query-groups", str(groups))]
    flags += attention_flags(arch)
    flags += [
        ("--seq-length", str(arch["seq_length"])),
        ("--max-position-embeddings", str(arch["max_position_embeddings"])),
        ("--position-embedding-type", arch["position_embedding"]),
        ("--normalization", arch["normalization"]),
    ]
    if arch["activation"] == "swiglu":
        flags.append(("--swiglu", None))
    elif arch["activation"] == "squared_relu":
        flags.append(("--squared-relu", None))
        if arch.get("bias", True):  # TransformerConfig fuses only gelu and swiglu with their bias (validate_args drops the fusion without biases)
            flags.append(("--no-bias-gelu-fusion", None))
    if arch.get("mrope_section"):
        flags.append(("--mrope-section", tuple(str(int(x)) for x in arch["mrope_section"])))
    if not arch.get("tied_embeddings", True):
        flags.append(("--untie-embeddings-and-output-weights", None))
    if not arch.get("bias", True):
        flags.append(("--disable-bias-linear", None))
        if arch.get("qkv_bias"):
            flags.append(("--add-qkv-bias", None))
    dropout = float(arch.get("dropout", 0.0) or 0.0)
    flags += [("--attention-dropout", repr(dropout)), ("--hidden-dropout", repr(dropout))]
    if arch.get("norm_epsilon") is not None:
        flags.append(("--norm-epsilon", repr(float(arch["norm_epsilon"]))))
    if arch["position_embedding"] in ("rope", "mrope"):
        flags += rope_flags(arch)
    return flags


def rope_flags(arch: dict[str, Any]) -> Flags:
    """--rotary-base, --rotary-percent and the rope scaling flags of an architecture() with rope (Megatron-LM core_v0.16.1
    RotaryEmbedding: ``rope_scaling`` / ``rope_scaling_factor`` for Llama 3.x, ``seq_len_interpolation_factor`` linear)."""
    flags: Flags = []
    if arch.get("rotary_base") is not None:
        flags.append(("--rotary-base", str(int(arch["rotary_base"]))))
    percent = arch.get("rotary_percent")
    if percent is not None and float(percent) != 1.0:
        flags.append(("--rotary-percent", repr(float(percent))))
    if arch.get("rope_scaling") == "llama3":
        flags += [("--use-rope-scaling", None), ("--rope-scaling-factor", repr(float(arch["rope_scaling_factor"])))]
    elif arch.get("rope_scaling") == "linear":
        flags.append(("--rotary-seq-len-interpolation-factor", str(int(arch["rope_scaling_factor"]))))
    return flags


def attention_flags(arch: dict[str, Any]) -> Flags:
    """--kv-channels (when it differs from hidden / heads), --qk-layernorm and the multi-latent attention flags.

    MLA runs megatron-core's MLATransformerConfig, whose rope_type defaults to yarn (DeepSeek-V3's long-context
    scaling); the model file's plain rope is ``--rope-type rope``, and MLATransformerConfig refuses rope fusion with
    plain rope, so ``--no-rope-fusion`` (Megatron-LM's default fuses). Flags: Megatron-LM core_v0.16.1 arguments.py.
    """
    flags: Flags = []
    heads, hidden, kv = arch["num_attention_heads"], arch["hidden_size"], arch.get("kv_channels")
    if kv is not None and not arch.get("multi_latent_attention") and (hidden % heads or kv != hidden // heads):
        flags.append(("--kv-channels", str(kv)))
    if arch.get("qk_layernorm"):
        flags.append(("--qk-layernorm", None))
    if arch.get("multi_latent_attention"):
        flags.append(("--multi-latent-attention", None))
        if arch.get("q_lora_rank") is not None:
            flags.append(("--q-lora-rank", str(arch["q_lora_rank"])))
        for key in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            flags.append(("--" + key.replace("_", "-"), str(arch[key])))
        flags += [("--rope-type", "rope"), ("--no-rope-fusion", None)]
    return flags


#: how the routed experts run: grouped GEMMs (as the planner costs them) and all-to-all token dispatch, the
#: dispatcher Megatron-LM recommends with expert parallelism (megatron-core 0.16.1 MoE README)
MOE_RUNTIME: Flags = [("--moe-grouped-gemm", None), ("--moe-token-dispatcher-type", "alltoall")]


def grouped_gemm_devices(plan: Plan) -> bool:
    """Whether every device of the plan runs Megatron's grouped GEMM: validate_args asserts compute capability >= 8
    with --moe-grouped-gemm (Megatron-LM core_v0.16.1 arguments.py). Profiles hold no compute capability; bf16 tensor
    cores came with it (Ampere, 8.0), so a device profile without a bf16 peak (V100 7.0, T4 7.5) runs the experts one
    after another (SequentialMLP: the same FLOPs) instead."""
    devices = (plan.assumptions or {}).get("devices") or {}
    return all("bf16" in (d.get("peak_flops") or {}) for d in devices.values())


def moe_flags(arch: dict[str, Any], lay: Any, grouped_gemm: bool = True) -> tuple[Flags, Flags]:
    """(GPT_MODEL_ARGS, MODEL_PARALLEL_ARGS) additions for a mixture of experts; nothing for a dense model.

    The expert-parallel sizes are always written for an MoE model: Megatron's --expert-tensor-parallel-size
    defaults to tp (validate_args), the Layout's etp to 1. ``--moe-layer-freq`` is the pattern's shortest exact
    form (:func:`planner.engines.megatron.moe.layer_freq_text`).
    """
    if not arch.get("num_experts"):
        return [], []
    model: Flags = [("--num-experts", str(arch["num_experts"])), ("--moe-router-topk", str(arch["moe_router_topk"]))]
    if arch.get("moe_ffn_hidden_size") is not None:
        model.append(("--moe-ffn-hidden-size", str(arch["moe_ffn_hidden_size"])))
    if arch.get("moe_shared_expert_intermediate_size") is not None:
        model.append(("--moe-shared-expert-intermediate-size", str(arch["moe_shared_expert_intermediate_size"])))
    if arch.get("moe_shared_expert_gate"):
        model.append(("--moe-shared-expert-gate", None))
    pattern = layer_pattern(arch.get("moe_layer_freq", 1), arch["num_layers"])
    if pattern != layer_pattern(1, arch["num_layers"]):
        model.append(("--moe-layer-freq", layer_freq_text(pattern)))
    model.append(("--moe-router-score-function", arch.get("moe_router_score_function", "softmax")))
    if arch.get("moe_router_pre_softmax"):
        model.append(("--moe-router-pre-softmax", None))
    if arch.get("moe_router_enable_expert_bias"):
        model.append(("--moe-router-enable-expert-bias", None))
    if arch.get("moe_router_num_groups") is not None:
        model += [("--moe-router-num-groups", str(arch["moe_router_num_groups"])), ("--moe-router-group-topk", str(arch["moe_router_group_topk"]))]
    if arch.get("moe_router_topk_scaling_factor") is not None:
        model.append(("--moe-router-topk-scaling-factor", repr(float(arch["moe_router_topk_scaling_factor"]))))
    balance = arch.get("moe_router_load_balancing_type", "aux_loss")
    model.append(("--moe-router-load-balancing-type", balance))
    if balance != "none":
        model.append(("--moe-aux-loss-coeff", repr(float(arch.get("moe_aux_loss_coeff") or 0.0))))
    model += [f for f in MOE_RUNTIME if grouped_gemm or f[0] != "--moe-grouped-gemm"]
    parallel: Flags = [("--expert-model-parallel-size", str(lay.ep)), ("--expert-tensor-parallel-size", str(lay.etp))]
    return model, parallel


# --------------------------------------------------------------------------- the flags


def flag_groups(plan: Plan) -> dict[str, Flags]:
    """The argument arrays of pretrain_gpt.sh, in order (TRAINING_ARGS lacks --train-iters: the script adds it)."""
    lay = plan.layout
    if lay.engine != "megatron":
        raise UsageError(f"the plan is for engine {lay.engine!r}, not megatron.")
    arch = architecture(plan)
    counts = planned_stage_layers(plan)
    if len(counts) != lay.pp * lay.vp:
        raise UsageError(f"plan.json has {len(counts)} stages but pp x vp = {lay.pp} x {lay.vp}; re-run `planner plan`.")
    dtype = plan.model.get("dtype") or plan.settings.model.dtype or "bf16"
    training: Flags = [("--micro-batch-size", str(lay.micro_batch)), ("--global-batch-size", str(lay.global_batch))]
    if dtype in ("bf16", "fp16"):
        training.append((f"--{dtype}", None))
    if lay.recompute == "selective":
        training.append(("--recompute-granularity", "selective"))
        if lay.recompute_modules:
            training.append(("--recompute-modules", tuple(lay.recompute_modules)))
    elif lay.recompute == "full":
        training += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"), ("--recompute-num-layers", "1")]
    elif lay.recompute != "none":
        raise UsageError(f"recompute mode {lay.recompute!r} has no Megatron-LM equivalent (none, selective, full).")
    if lay.zero >= 1:
        training.append(("--use-distributed-optimizer", None))
    feature_training, feature_parallel = feature_flags(plan)
    training += feature_training
    training += list(HYPERPARAMETERS)
    parallel: Flags = [("--tensor-model-parallel-size", str(lay.tp)), ("--pipeline-model-parallel-size", str(lay.pp))]
    parallel += split_flags(counts, lay.pp)
    if lay.microbatch_group:  # the interleaved schedule's micro-batches per chunk group, where not Megatron's default p
        parallel.append(("--microbatch-group-size-per-virtual-pipeline-stage", str(lay.microbatch_group)))
    if lay.tp > 1:
        parallel.append(("--sequence-parallel", None))
    parallel += feature_parallel
    moe_model, moe_parallel = moe_flags(arch, lay, grouped_gemm_devices(plan))
    parallel += moe_parallel
    vocab_arg, divisible = vocab_flags(arch["vocab_size"], lay.tp)
    data: Flags = [
        ("--mock-data", None),
        ("--tokenizer-type", "NullTokenizer"),
        ("--vocab-size", str(vocab_arg)),
        ("--make-vocab-size-divisible-by", str(divisible)),
    ]
    logging: Flags = [("--log-interval", "1"), ("--eval-interval", "1000"), ("--eval-iters", "10")]
    return {
        "GPT_MODEL_ARGS": model_flags(arch) + moe_model,
        "TRAINING_ARGS": training,
        "MODEL_PARALLEL_ARGS": parallel,
        "DATA_ARGS": data,
        "EVAL_AND_LOGGING_ARGS": logging,
    }


#: FP8 recipe the renderer writes: Transformer Engine's hybrid format (e4m3 forward, e5m2 gradients) with delayed scaling
#: over an amax history of 1024 steps, the largest amax of the window (Megatron-LM / NeMo FP8 examples)
FP8_FLAGS: Flags = [("--fp8-format", "hybrid"), ("--fp8-recipe", "delayed"), ("--fp8-amax-history-len", "1024"), ("--fp8-amax-compute-algo", "max")]


def feature_flags(plan: Plan) -> tuple[Flags, Flags]:
    """(TRAINING_ARGS, MODEL_PARALLEL_ARGS) additions for the layout's overlaps, precision options, FP8 and context
    parallelism (flag names and choices from Megatron-LM core_v0.16.1's arguments.py and TransformerConfig)."""
    lay = plan.layout
    training: Flags = []
    if lay.overlap_grad_reduce:
        training.append(("--overlap-grad-reduce", None))
    if lay.overlap_param_gather:
        training.append(("--overlap-param-gather", None))
    if precision_aware(lay):
        # TE's FusedAdam keeps the moments (and takes the main gradients) in the asked dtypes
        training += [
            ("--use-precision-aware-optimizer", None),
            ("--main-grads-dtype", lay.main_grads_dtype),
            ("--exp-avg-dtype", lay.optimizer_state_dtype),
            ("--exp-avg-sq-dtype", lay.optimizer_state_dtype),
        ]
    elif lay.main_grads_dtype == "bf16":
        training.append(("--grad-reduce-in-bf16", None))
    if lay.fp8:
        training += FP8_FLAGS
        if lay.fp8_param_gather:  # FP8 primary weights (TransformerConfig.fp8_param), gathered in FP8
            training.append(("--fp8-param-gather", None))
    parallel: Flags = []
    if lay.cp > 1:
        parallel.append(("--context-parallel-size", str(lay.cp)))
        if lay.cp_comm != "p2p":  # arguments.py's default is p2p (the ring)
            parallel.append(("--cp-comm-type", lay.cp_comm))
    if lay.tp_comm_overlap:
        parallel.append(("--tp-comm-overlap", None))
    if lay.ep_comm_overlap:  # the combined 1F1B schedule (TransformerConfig.overlap_moe_expert_parallel_comm)
        parallel.append(("--overlap-moe-expert-parallel-comm", None))
    return training, parallel


def _split_description(counts: list[int], pp: int) -> list[str]:
    """One line per pipeline rank: its decoder layers per virtual stage."""
    vp = len(counts) // pp
    out = []
    start = 0
    ranges: list[tuple[int, int]] = []
    for k in counts:
        ranges.append((start, start + k))
        start += k
    for r in range(pp):
        chunks = []
        for c in range(vp):
            a, b = ranges[c * pp + r]
            chunks.append(f"layers {a}-{b - 1}" if b - a > 1 else f"layer {a}" if b - a == 1 else "no layers")
        extra = (" + embedding" if r == 0 else "") + (" + final norm, output layer, loss" if r == pp - 1 else "")
        out.append(f"pipeline rank {r}: " + " | ".join(chunks) + extra)
    return out


def _context(plan: Plan, command: str) -> dict[str, Any]:
    lay = plan.layout
    groups = flag_groups(plan)
    counts = planned_stage_layers(plan)
    nodes, per_node = cluster_shape(plan)
    arch = architecture(plan)
    vocab_arg, divisible = vocab_flags(arch["vocab_size"], lay.tp)
    split = dict(groups["MODEL_PARALLEL_ARGS"])
    if "--pipeline-model-parallel-layout" in split:
        split_kind = f"--pipeline-model-parallel-layout {split['--pipeline-model-parallel-layout']}"
    elif "--decoder-first-pipeline-num-layers" in split or "--decoder-last-pipeline-num-layers" in split:
        split_kind = "uneven first/last stages (" + ", ".join(f"{k} {v}" for k, v in split.items() if k.startswith("--decoder-")) + ")"
    else:
        split_kind = "even split"
    return {
        "command": one_line(command),
        "megatron_version": MEGATRON_VERSION,
        "lay": lay,
        "world": lay.world,
        "nodes": nodes,
        "per_node": per_node,
        "groups": groups,
        "argv_groups": {g: [[name, *_values(value)] for name, value in pairs] for g, pairs in groups.items()},
        "tp_env": lay.tp > 1 or lay.cp > 1,
        "train_iters": DEFAULT_TRAIN_ITERS,
        "split_lines": [one_line(x) for x in _split_description(counts, lay.pp)],
        "split_kind": one_line(split_kind),
        "counts": counts,
        "arch": arch,
        "dtype": plan.model.get("dtype") or plan.settings.model.dtype or "bf16",
        "model_file": one_line(plan.settings.model.model_file),
        "model_args": one_line(", ".join(f"{k}={v}" for k, v in sorted((plan.settings.model.model_args or {}).items())) or "none"),
        "vocab": arch["vocab_size"],
        "vocab_arg": vocab_arg,
        "divisible": divisible,
        "padded_vocab": padded_vocab(vocab_arg + 1, lay.tp, divisible),
        "hyperparameters": HYPERPARAMETERS,
        "moe_layers": sum(layer_pattern(arch.get("moe_layer_freq", 1), arch["num_layers"])) if arch.get("num_experts") else 0,
        "grouped_gemm": grouped_gemm_devices(plan),
        "job_name": job_name(plan),
        "script": SCRIPT,
    }


def _values(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)


def rendered_args(ctx: dict[str, Any]) -> MegatronArgs:
    """The flags pretrain_gpt.sh passes, as data: every array in order (``--train-iters`` at its default), the launch environment and world."""
    flags: list[Flag] = []
    for group, pairs in ctx["groups"].items():
        if group == "TRAINING_ARGS":
            pairs = [("--train-iters", str(ctx["train_iters"]))] + list(pairs)
        flags += [Flag(name, _values(value), None) for name, value in pairs]
    env = (EnvVar("CUDA_DEVICE_MAX_CONNECTIONS", "1"),) if ctx["tp_env"] else ()
    return MegatronArgs("script", tuple(flags), env=env, nproc_per_node=ctx["per_node"], nnodes=ctx["nodes"], script="pretrain_gpt.py")


def render(plan: Plan, command: str, out_dir: Path | None = None) -> dict[str, str]:
    """pretrain_gpt.sh, launch_slurm.sh and README.md for ``plan`` (deterministic; values shell-quoted).

    Raises UsageError when the model or the plan does not map onto Megatron-LM, or when the
    rendered flags break one of Megatron's rules (planner.engines.megatron.architecture).
    """
    ctx = _context(plan, command)
    args = rendered_args(ctx)
    findings = errors(check_megatron_args(args, ctx["world"]))
    if findings:
        raise UsageError(
            "Megatron-LM would refuse this plan's flags:\n" + "\n".join(f"  {f}" for f in findings),
            "Pin other --tp/--pp/--vp/--global-batch values, or fix plan.json. (`planner plan --engine megatron` should never "
            "choose such a layout: if it did, please report it.)",
        )
    built = stage_layers(args)
    if built != ctx["counts"]:  # split_flags guarantees this; a mismatch is a planner bug
        raise RuntimeError(f"rendered flags build stages {built}, the plan has {ctx['counts']}")
    return {
        SCRIPT: render_template("megatron/pretrain_gpt.sh.j2", **ctx),
        "launch_slurm.sh": render_template("megatron/launch_slurm.sh.j2", **ctx),
        "README.md": render_template("megatron/README.md.j2", **ctx),
    }
