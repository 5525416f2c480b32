"""Megatron-LM (pretrain_gpt.py building its own GPT model from flags).

Facts (Megatron-LM core_v0.16.1; README "Engine rules"): stages can only be cut
between whole transformer layers, with the final norm, output layer and loss on
the last stage; it runs 1F1B or interleaved 1F1B (virtual stages), tensor and
sequence parallelism, the distributed optimizer (6 + 12/d bytes per parameter)
and fp32 main gradients (18 bytes per parameter without it). Interleaving needs
the number of micro-batches to be a multiple of pp and at least pp (point-to-point
overlap is on by default, so pp = 2 interleaves too).

Overlaps (layout fields): ``--overlap-grad-reduce`` reduces gradient buckets during
the last micro-batch's backward (the earlier micro-batches only accumulate);
``--overlap-param-gather`` (distributed optimizer only, with --overlap-grad-reduce:
validate_args asserts both) all-gathers the updated parameters bucket by bucket under
the next step's first forward. Buckets hold max(40M, 1M x dp) parameters
(DistributedDataParallel's default ``bucket_size``); :func:`grad_reduce_exposed` and
:func:`param_gather_exposed` give what each leaves exposed, bucket by bucket. ``--tp-comm-overlap`` needs ``--sequence-parallel`` (validate_args) and
Transformer Engine, the default ``--transformer-impl``.

Precision options (TE's FusedAdam behind ``--use-precision-aware-optimizer``, which
OptimizerConfig allows only with Adam and the distributed optimizer): bf16 or fp16 Adam
moments (``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``), bf16 main gradients
(``--main-grads-dtype bf16``; without the precision-aware optimizer ``--grad-reduce-in-bf16``). With bf16 weights the
precision-aware optimizer keeps 2-byte remainders of the fp32 master weights (:data:`MASTER_REMAINDER_BYTES`).
Context parallelism (``--context-parallel-size``) needs the sequence length to divide by 2 x cp.
FP8 runs Transformer Engine's FP8 GEMMs (``--fp8-format``, ``--fp8-recipe``): TE keeps an FP8 copy and an FP8
transpose of each bf16 weight, cached across the micro-batches of a step (Megatron passes is_first_microbatch), 2 bytes
per parameter more; ``--fp8-param-gather`` (FP8 primary weights, distributed optimizer only) keeps the weight only in
FP8 plus its transpose: 2 bytes per parameter in place of 4.

The loss is computed inside the model (GPTModel: the output layer, then tensor_parallel.vocab_parallel_cross_entropy),
so the last stage sends nothing and holds no buffers for the model's output (:attr:`MegatronEngine.model_io_buffers`).
Its working set is :func:`megatron_loss_working_set`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from planner.engines.base import Engine, repeated_layers, whole_block_cuts
from planner.engines.megatron.activations import CORE_ATTN, LayerShape, PartBytes, part_bytes
from planner.engines.megatron.architecture import (
    ARCHITECTURE,
    MODELLED_RECOMPUTE_MODULES,
    RECOMPUTE_MODULES,
    architecture_defaults,
    architecture_problem,
    recompute_module_problems,
    tensor_parallel_problems,
)
from planner.engines.megatron.hf_shapes import hf_architecture, hf_architecture_gap
from planner.engines.megatron.moe import layer_pattern
from planner.engines.megatron.moe_activations import AUX_LOSSES, MLAShape, megatron_layer_saved
from planner.engines.megatron.recompute import NO_RECOMPUTE, dense_mlp_work, mla_up_proj_work
from planner.engines.megatron.traffic import ROTARY, layer_traffic, part_traffic
from planner.records import DEFAULT_LOSS, Layer, LossRun, ModelCosts, RecomputeWork, evolve
from planner.solve.memory import DTYPE_BYTES, StateRecipe, state_recipe
from planner.solve.plan import LAYOUT_UPGRADES, Layout, ep_overlap_allowed
from planner.solve.schedules import group_constraints
from planner.solve.search import FP8_AMAX_HISTORY, TP_OVERLAP_BUFFERS

#: DistributedDataParallel's default bucket: max(40,000,000, 1,000,000 x data-parallel size) parameters
#: (megatron/core/distributed/distributed_data_parallel.py, core_v0.16.1)
BUCKET_MIN_PARAMS = 40_000_000
BUCKET_PARAMS_PER_DP_RANK = 1_000_000


#: architecture() keys of a dense GPT layer (the table up to kv_channels): with any other key set off its default
#: (q/k norms, multi-latent attention, experts) the blocks' saved activations stay as traced
DENSE_KEYS = frozenset(k.name for k in ARCHITECTURE[: [a.name for a in ARCHITECTURE].index("qk_layernorm")]) | {"block_path"}
_ARCH_DEFAULTS = {k.name: k.default for k in ARCHITECTURE}


def dense_layer(arch: dict[str, Any]) -> bool:
    """Whether ``arch`` describes Megatron's dense GPT layer: every key beyond :data:`DENSE_KEYS` unset or at its default."""
    return all(k in DENSE_KEYS or v is None or v is False or v == _ARCH_DEFAULTS.get(k) for k, v in arch.items())


#: architecture() keys whose layers megatron_moe_activations derives: every ARCHITECTURE key (q/k norms, multi-latent
#: attention, experts included) and the block path; with any other key the blocks' saved activations stay as traced
LAYER_KEYS = frozenset(k.name for k in ARCHITECTURE) | {"block_path"}


def megatron_layer(arch: dict[str, Any]) -> bool:
    """Whether Megatron's own layers for ``arch`` have a closed form here: the dense GPT layer (:func:`dense_layer`), or
    every key one of :data:`LAYER_KEYS` with a balancing loss other than sinkhorn."""
    if dense_layer(arch):
        return True
    if any(k not in LAYER_KEYS for k in arch):
        return False
    return not arch.get("num_experts") or arch.get("moe_router_load_balancing_type") in (None, "none") + AUX_LOSSES


def block_pieces(costs: ModelCosts) -> dict[str, list[int]]:
    """Indices of each transformer layer's pieces (:func:`repeated_layers`: a final norm that is a block of its own is
    not a layer), by block path, in execution order."""
    blocks: dict[str, list[int]] = {}
    for k, b in enumerate(repeated_layers([l.block for l in costs.layers])):
        if b is not None:
            blocks.setdefault(b, []).append(k)
    return blocks


def part_pieces(layers: Sequence[Layer], ks: Sequence[int]) -> tuple[tuple[int, str], ...]:
    """Where one block's sub-layers go among its pieces ``ks``: the attention to its first piece of kind ``attention``
    (else its first piece), the MLP to its first piece of kind ``mlp`` (else its last). Megatron cuts whole layers only,
    so only the block's total counts."""
    attn = next((k for k in ks if layers[k].kind == "attention"), ks[0])
    mlp = next((k for k in ks if layers[k].kind == "mlp"), ks[-1])
    return ((attn, "attention"), (mlp, "mlp"))


def megatron_blocks(costs: ModelCosts) -> tuple[dict[str, list[int]], list[bool]] | None:
    """The transformer blocks' pieces (:func:`block_pieces`) and which blocks are MoE layers, when Megatron's own layers
    have a closed form for ``costs`` (:func:`megatron_layer`, the block count its ``num_layers``, the MoE blocks those
    of its ``moe_layer_freq``); None otherwise."""
    arch = costs.architecture
    blocks = block_pieces(costs)
    if not arch or not costs.seq_len or not megatron_layer(arch) or len(blocks) != int(arch.get("num_layers", -1)):
        return None
    is_moe = [any(costs.layers[k].num_experts for k in ks) for ks in blocks.values()]
    if arch.get("num_experts"):
        if is_moe != [bool(x) for x in layer_pattern(architecture_defaults(arch)["moe_layer_freq"], len(blocks))]:
            return None
    elif any(is_moe):
        return None
    return blocks, is_moe


def explicit_attention(costs: ModelCosts, blocks: Mapping[str, Sequence[int]]) -> bool:
    """Whether the traced blocks compute attention explicitly: a piece with s x s operators (``core_bytes_fwd``: the
    scores, softmax and dropout the cost meter records as the attention core) rather than one fused kernel."""
    return any(costs.layers[k].core_bytes_fwd > 0 for ks in blocks.values() for k in ks)


def megatron_layer_activations(
    costs: ModelCosts, tp: int, sequence_parallel: bool, cp: int, recompute: str, etp: int = 1, modules: frozenset[str] = CORE_ATTN
) -> ModelCosts:
    """``costs`` (scaled and sharded) with each transformer block's saved bytes those of Megatron's own TE layer
    (planner.engines.megatron.activations; MoE layers, MLA and q/k norms: planner.engines.megatron.moe_activations, with
    ``etp`` the expert tensor-parallel size), for an ``architecture()`` of :func:`megatron_layer` whose block count is
    its ``num_layers`` and whose MoE blocks (a piece with routed experts) are those of its ``moe_layer_freq``; otherwise
    unchanged. Megatron cuts whole layers only, so a block's total is what counts: the attention sub-layer's bytes go
    to the block's first piece of kind ``attention`` (else its first piece), the MLP's to its first piece of kind
    ``mlp`` (else its last), its other pieces keep none. The embedding, final norm, output layer and loss stay as
    traced; full recompute keeps each layer's input (the traced cut), and the rebuilt layer is this one. Under
    selective recomputation, what ``modules`` drop is the blocks' ``core_saved_bytes``.

    The core attention is priced as the blocks were traced, as :func:`megatron_layer_traffic` prices its kernels: a
    fused kernel keeps TE's flash set, an explicit one (s x s operators traced: :func:`explicit_attention`) the unfused
    softmax's s x s tensors (TE's UnfusedDotProductAttention, Megatron's legacy CoreAttention: softmax output, dropout
    mask and dropout output), so time and memory describe the same kernel."""
    arch = costs.architecture
    found = megatron_blocks(costs)
    if found is None or arch is None or not costs.seq_len:
        return costs
    blocks, is_moe = found
    layers = list(costs.layers)
    mode = "selective" if recompute == "selective" else "none"
    dtype = DTYPE_BYTES.get(costs.dtype, 2.0)
    kernel = "explicit" if explicit_attention(costs, blocks) else "flash"
    parts: dict[bool, dict[str, PartBytes]] = {}
    for moe in set(is_moe):
        terms = megatron_layer_saved(arch, moe, costs.seq_len // cp, costs.micro_batch, tp, sequence_parallel, etp, dtype, mode, modules or CORE_ATTN, kernel)
        parts[moe] = {p: part_bytes(terms, p) for p in ("attention", "mlp")}
    for ks, moe in zip(blocks.values(), is_moe):
        sums: dict[int, list[float]] = {k: [0.0, 0.0, 0.0, 0.0] for k in ks}
        for k, part in part_pieces(layers, ks):
            pb = parts[moe][part]
            for i, x in enumerate((pb.total, pb.gemm, pb.shared, pb.core)):
                sums[k][i] += x
        for k, (total, gemm, shared, core) in sums.items():
            layers[k] = evolve(layers[k], saved_bytes=int(total), gemm_saved_bytes=int(gemm), gemm_shared_bytes=int(shared), core_saved_bytes=int(core))
    return evolve(costs, layers=tuple(layers))


#: bytes per token megatron-core's vocab-parallel cross entropy saves beside its fp32 softmax: the target mask (bool, 1)
#: and the masked target ids (int64, 8)
LOSS_TOKEN_BYTES = 9.0


def megatron_loss_working_set(costs: ModelCosts, tp: int, cp: int) -> ModelCosts:
    """``costs`` (scaled and sharded) with the last piece's working set that of Megatron's loss, when that piece is the
    output layer and ``architecture()`` gives the vocabulary; otherwise unchanged.

    megatron-core's _VocabParallelCrossEntropy (tensor_parallel/cross_entropy.py, core_v0.16.1 and core_r0.8.0) takes the
    output layer's logits (micro-batch x seq / cp x vocab / tp, in the training dtype), makes one fp32 copy, subtracts the
    maximum, exponentiates and normalises it in place and saves it for backward (the piece's saved bytes, as traced: the
    user's loss keeps its fp32 log-softmax, the same size); its backward turns that tensor into the gradient in place and
    autograd casts it to the logits' dtype. Beyond what is saved, the logits then live once: forward until the loss returns,
    backward as their gradient. The traced loss (the user's loss_fn on the model output) is not what runs.

    So the piece keeps the output layer's input (its cut, as sharded), the fp32 copy of its vocabulary shard (4 bytes
    per logit) and, per token, the target mask (bool) and masked target ids (int64) the loss saves with it
    (``ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)``): the logits are split over tp with or
    without sequence parallelism (the traced piece's saved bytes are divided by tp only with it, since its input is
    replicated without)."""
    arch = costs.architecture or {}
    vocab = arch.get("vocab_size")
    if not costs.layers or costs.layers[-1].kind != "head" or not vocab or not costs.seq_len:
        return costs
    tokens = costs.micro_batch * (costs.seq_len / cp)
    elems = tokens * (int(vocab) / tp)
    logits = elems * DTYPE_BYTES.get(costs.dtype, 2.0)
    saved = costs.cuts[costs.n - 1].bytes + elems * DTYPE_BYTES["fp32"] + tokens * LOSS_TOKEN_BYTES
    head = evolve(costs.layers[-1], max_op_bytes=int(logits), saved_bytes=int(saved), core_saved_bytes=0, gemm_saved_bytes=0, gemm_shared_bytes=0)
    return evolve(costs, layers=costs.layers[:-1] + (head,))


def megatron_recompute_work(costs: ModelCosts, tp: int, sequence_parallel: bool, cp: int, modules: frozenset[str]) -> tuple[RecomputeWork, ...] | None:
    """Per piece of the sharded ``costs``: what ``mla_up_proj`` and ``mlp`` (dense layers) recompute
    (planner.engines.megatron.recompute), placed on the pieces :func:`megatron_layer_activations` gives the
    sub-layers' bytes; None when neither is among ``modules`` (the traced attention core is then all) or when
    Megatron's layers have no closed form here (layouts with such modules are refused then:
    :meth:`MegatronEngine.recompute_module_problems`)."""
    arch = costs.architecture
    if not modules & {"mla_up_proj", "mlp"}:
        return None
    found = megatron_blocks(costs)
    if found is None or arch is None or not costs.seq_len:
        return None
    blocks, is_moe = found
    shape = LayerShape.from_architecture(arch)
    dtype = DTYPE_BYTES.get(costs.dtype, 2.0)
    tokens = costs.seq_len // cp
    work = [NO_RECOMPUTE] * costs.n
    attn = (
        mla_up_proj_work(shape, MLAShape.from_architecture(arch), tokens, costs.micro_batch, tp, sequence_parallel, dtype)
        if "mla_up_proj" in modules
        else NO_RECOMPUTE
    )
    mlp = dense_mlp_work(shape, tokens, costs.micro_batch, tp, sequence_parallel, dtype) if "mlp" in modules else NO_RECOMPUTE
    for ks, moe in zip(blocks.values(), is_moe):
        for k, part in part_pieces(costs.layers, ks):
            work[k] = work[k] + (attn if part == "attention" else NO_RECOMPUTE if moe else mlp)
    return tuple(work)


def megatron_layer_traffic(costs: ModelCosts, tp: int, sequence_parallel: bool, cp: int) -> ModelCosts:
    """``costs`` (scaled and sharded) with each transformer block's memory-bound kernels those of Megatron's own TE
    layer (planner.engines.megatron.traffic), for a dense ``architecture()`` (q/k norms allowed; no experts, no
    multi-latent attention) whose block count is its ``num_layers`` and whose traced attention is fused (no piece
    with s x s operators: explicit attention keeps its traced kernels, the s x s ones being most of them); otherwise
    unchanged. The bytes go to the block's pieces as :func:`megatron_layer_activations` places the saved bytes; the
    GEMM and attention-core FLOPs stay as traced."""
    arch = costs.architecture
    blocks = block_pieces(costs)
    if not arch or not costs.seq_len or not megatron_layer(arch) or arch.get("num_experts") or arch.get("multi_latent_attention"):
        return costs
    layers = list(costs.layers)
    if len(blocks) != int(arch.get("num_layers", -1)) or explicit_attention(costs, blocks) or any(layers[k].num_experts for ks in blocks.values() for k in ks):
        return costs
    a = architecture_defaults(arch)
    kernels = layer_traffic(
        LayerShape.from_architecture(arch),
        costs.seq_len // cp,
        costs.micro_batch,
        tp,
        sequence_parallel,
        DTYPE_BYTES.get(costs.dtype, 2.0),
        rotary=a["position_embedding"] in ROTARY,
        qk_norm=bool(a.get("qk_layernorm")),
        bias=bool(a["bias"]),
    )
    parts = {p: part_traffic(kernels, p) for p in ("attention", "mlp")}
    for ks in blocks.values():
        fwd: dict[int, tuple[float, ...]] = {k: () for k in ks}
        bwd: dict[int, tuple[float, ...]] = {k: () for k in ks}
        for k, part in part_pieces(layers, ks):
            fwd[k] += parts[part][0]
            bwd[k] += parts[part][1]
        for k in ks:
            layers[k] = evolve(
                layers[k],
                op_bytes_fwd=fwd[k],
                op_bytes_bwd=bwd[k],
                op_bytes_fwd_resid=(),
                op_bytes_bwd_resid=(),
                mem_bytes_fwd=sum(fwd[k]),
                mem_bytes_bwd=sum(bwd[k]),
            )
    return evolve(costs, layers=tuple(layers))


#: bytes per parameter of the master weights under the precision-aware optimizer with bf16 weights: TE's FusedAdam stores
#: the 16-bit remainders of the fp32 master weights (OptimizerConfig.store_param_remainders, True by default, with
#: use_precision_aware_optimizer_no_fp8_or_ds_fp8: no FP8 recipe or the delayed one the renderer writes;
#: megatron/core/optimizer/optimizer_config.py and distrib_optimizer.py, core_v0.16.1: the master shard is int16)
MASTER_REMAINDER_BYTES = 2.0


def precision_aware(layout: Layout) -> bool:
    """Whether the layout runs Megatron's precision-aware optimizer (``--use-precision-aware-optimizer``): half-precision
    Adam moments, or bf16 main gradients with the distributed optimizer (what the renderer writes for them)."""
    return layout.optimizer_state_dtype != "fp32" or (layout.main_grads_dtype != "fp32" and layout.zero >= 1)


def bucket_params(data_parallel: int) -> int:
    """Parameters in one gradient bucket for a data-parallel group of ``data_parallel`` (x cp) ranks."""
    return max(BUCKET_MIN_PARAMS, BUCKET_PARAMS_PER_DP_RANK * data_parallel)


def grad_reduce_exposed(comm_s: float, backward_s: float, buckets: int) -> float:
    """Seconds of a gradient reduction of ``comm_s`` in ``buckets`` equal buckets left after a backward of ``backward_s``.

    Megatron launches a bucket's reduction (asynchronously, on the one communication stream, in issue order) once
    every gradient in it is ready, and only in the last micro-batch (``Bucket.register_grad_ready`` when
    ``is_last_microbatch``; the earlier ones run under ``no_sync``: megatron/core/distributed/param_and_grad_buffer.py
    and pipeline_parallel/schedules.py, core_r0.8.0; the same in core_v0.16.1). Buckets fill in backward order, one
    every b = backward / n; each takes r = comm / n, so the last finishes at max_k (k b + (n - k + 1) r):
    ``max(r, comm - backward + b)`` after the backward ends."""
    if comm_s <= 0:
        return 0.0
    n = max(1, buckets)
    r, b = comm_s / n, backward_s / n
    return max(r, comm_s - backward_s + b)


def param_gather_exposed(comm_s: float, forward_s: float, buckets: int) -> float:
    """Seconds of a parameter all-gather of ``comm_s`` in ``buckets`` equal buckets left exposed by a forward of
    ``forward_s``.

    The first bucket's all-gather is dispatched after the optimizer step and waited for by the first forward; each
    bucket's forward pre-hook waits for its own all-gather and only then dispatches the next one (so communication
    never head-of-line blocks compute under CUDA_DEVICE_MAX_CONNECTIONS=1: DistributedOptimizer
    ``_dispatch_gather_model_params`` / ``_finish_param_sync_helper``, megatron/core/optimizer/distrib_optimizer.py,
    core_r0.8.0; ``next_param_gather_bucket_group`` in param_and_grad_buffer.py, core_v0.16.1). Bucket i + 1's
    all-gather a = comm / n overlaps bucket i's forward f = forward / n: ``a + (n - 1) max(0, a - f)``."""
    if comm_s <= 0:
        return 0.0
    n = max(1, buckets)
    a, f = comm_s / n, forward_s / n
    return a + (n - 1) * max(0.0, a - f)


class MegatronEngine(Engine):
    name = "megatron"
    description = "Megatron-LM pretrain_gpt.py (1F1B or interleaved, tensor/sequence parallel, distributed optimizer)"
    schedules = ("1f1b", "interleaved")
    searched_schedules = ("1f1b", "interleaved")
    microbatch_groups = True
    zero_levels = (0, 1)
    tensor_parallel = True
    sub_block_cuts = False
    recompute_modes = ("none", "selective", "full")
    recompute_modules = MODELLED_RECOMPUTE_MODULES
    recompute_module_names = RECOMPUTE_MODULES
    context_parallel = True
    #: --cp-comm-type (arguments.py core_v0.16.1: nargs='+', default ['p2p']; the value goes verbatim to Transformer
    #: Engine's DotProductAttention, whose types are p2p, all_gather, a2a and a2a+p2p: megatron-core 0.16.1
    #: transformer_config.py cp_comm_type). a2a+p2p needs --hierarchical-context-parallel-sizes and is not planned
    cp_comm_types = ("p2p", "all_gather", "a2a")
    expert_parallel = True
    #: train_step calls zero_grad_buffer() on every model chunk before the forward-backward, which zeroes the whole
    #: contiguous gradient buffer (ParamAndGradBuffer.reset: ``self.grad_data.zero_()``; megatron/training/training.py
    #: and megatron/core/distributed/{distributed_data_parallel,param_and_grad_buffer}.py, core_v0.16.1 and core_r0.8.0)
    zeroes_grad_buffer = True
    model_io_buffers = False
    title = "Megatron-LM"
    fp8_primary_weights = True
    own_loss = "Megatron's own GPT cross-entropy of the next token (pretrain_gpt.py builds the model from flags; the model file's loss does not run)"
    overlaps = ("tp-comm-overlap", "overlap-grad-reduce", "overlap-param-gather", "overlap-moe-expert-parallel-comm")
    precision_options = True
    fp8 = True
    #: Transformer Engine's userbuffers of --tp-comm-overlap and its delayed-scaling amax history (the renderer's
    #: --fp8-amax-history-len): planner.solve.search.TP_OVERLAP_BUFFERS, FP8_AMAX_HISTORY
    tp_overlap_buffers = float(TP_OVERLAP_BUFFERS)
    fp8_amax_history = FP8_AMAX_HISTORY

    def state_recipe(self, precision: str, zero: int, optimizer: str = "adam", layout: Layout | None = None) -> StateRecipe:
        # bf16/fp16 weights, fp32 main grads (or bf16), fp32 master + Adam moments (or bf16); zero >= 1 is the distributed optimizer
        grads = layout.main_grads_dtype if layout is not None else "fp32"
        states = layout.optimizer_state_dtype if layout is not None else "fp32"
        grad = DTYPE_BYTES[grads] if precision in ("bf16", "fp16") else None
        fp8 = layout is not None and layout.fp8
        fp8_params = fp8 and layout is not None and layout.fp8_param_gather and precision in ("bf16", "fp16")
        recipe = state_recipe(precision, optimizer, grad_bytes=grad, zero=1 if zero >= 1 else 0, state_dtype=states, fp8=fp8, fp8_params=fp8_params)
        if layout is not None and precision == "bf16" and not fp8_params and precision_aware(layout):
            # TE's FusedAdam keeps only the 16 low bits of each fp32 master weight (the high 16 are the bf16 weight)
            recipe = evolve(recipe, master_bytes=MASTER_REMAINDER_BYTES)
        return recipe

    def exposed_dp_time(
        self, layout: Layout, reduce_s: float, gather_s: float, backward_s: Sequence[float], forward_s: Sequence[float], params: float
    ) -> float:
        buckets = math.ceil(params / bucket_params(layout.dp * layout.cp)) if params > 0 else 1
        reduce = grad_reduce_exposed(reduce_s, sum(backward_s), buckets) if layout.overlap_grad_reduce else reduce_s
        gather = param_gather_exposed(gather_s, sum(forward_s), buckets) if layout.overlap_param_gather else gather_s
        return reduce + gather

    def blocking_sends(self, layout: Layout) -> bool:
        """The non-interleaved schedule's exchanges block: megatron-core's p2p_communication._communicate (core_v0.16.1)
        batches each send with the receive it pairs with (``batch_p2p_comm``, on unless ``overlap_p2p_comm``), waits
        on every request and then synchronises the device (``batch_p2p_sync``, on by default), so the stage's next
        pass starts only when its send is done. The interleaved schedule overlaps them (Megatron-LM's
        ``overlap_p2p_comm`` is on unless --no-overlap-p2p-communication, which the planner does not render)."""
        return layout.vp == 1

    def layer_activations(
        self,
        costs: ModelCosts,
        tp: int,
        sequence_parallel: bool,
        cp: int,
        recompute: str,
        etp: int = 1,
        modules: frozenset[str] = frozenset(),
        loss: LossRun = DEFAULT_LOSS,
    ) -> ModelCosts:
        """pretrain_gpt.py runs its own TE layer and loss, not the user's module: :func:`megatron_layer_activations`,
        :func:`megatron_loss_working_set`."""
        layers = megatron_layer_activations(costs, tp, sequence_parallel, cp, recompute, etp, modules or CORE_ATTN)
        return megatron_loss_working_set(layers, tp, cp)

    def recompute_work(self, costs: ModelCosts, tp: int, sequence_parallel: bool, cp: int, modules: frozenset[str]) -> tuple[RecomputeWork, ...] | None:
        """:func:`megatron_recompute_work`."""
        return megatron_recompute_work(costs, tp, sequence_parallel, cp, modules)

    def layer_traffic(self, costs: ModelCosts, tp: int, sequence_parallel: bool, cp: int) -> ModelCosts:
        """pretrain_gpt.py runs its own TE layer, not the user's module: :func:`megatron_layer_traffic`."""
        return megatron_layer_traffic(costs, tp, sequence_parallel, cp)

    def default_overlaps(self, tp: int, zero: int, data_parallel: int) -> dict[str, bool]:
        return {
            "overlap_grad_reduce": data_parallel > 1 or zero >= 1,
            "overlap_param_gather": data_parallel > 1 and zero >= 1,
        }

    def recompute_module_problems(self, modules: tuple[str, ...], costs: ModelCosts) -> list[str]:
        """Megatron's own rules for ``modules`` (planner.engines.megatron.architecture.recompute_module_problems), and modules beyond
        core_attn only where Megatron's layers have a closed form here (:func:`megatron_blocks`)."""
        out = recompute_module_problems(modules, costs.architecture)
        if set(modules) - {"core_attn"} and megatron_blocks(costs) is None:
            out.append("recompute modules other than core_attn need Megatron's own layers in closed form (an architecture() with one block per layer)")
        return out

    def feature_problems(self, layout: Layout, costs: ModelCosts) -> list[str]:
        out = super().feature_problems(layout, costs)
        if layout.tp_comm_overlap and not (layout.tp > 1 and layout.sequence_parallel):
            out.append("--tp-comm-overlap needs tensor parallelism with --sequence-parallel (validate_args asserts it)")
        if layout.ep_comm_overlap and not ep_overlap_allowed(layout):
            out.append(
                "--overlap-moe-expert-parallel-comm needs expert parallelism (ep > 1), virtual pipeline stages when pp > 1 and no full"
                " recomputation (TransformerConfig asserts them)"
            )
        if layout.overlap_param_gather and not (layout.zero >= 1 and layout.overlap_grad_reduce):
            out.append("--overlap-param-gather needs the distributed optimizer (zero 1) and --overlap-grad-reduce (validate_args asserts both)")
        if layout.optimizer_state_dtype not in ("fp32", "bf16", "fp16"):
            out.append(f"Megatron keeps Adam moments in fp32, bf16 or fp16 (--exp-avg-dtype), not {layout.optimizer_state_dtype}")
        if layout.main_grads_dtype not in ("fp32", "bf16"):
            out.append(f"Megatron keeps main gradients in fp32 or bf16 (--main-grads-dtype), not {layout.main_grads_dtype}")
        if layout.optimizer_state_dtype != "fp32" and layout.zero < 1:
            out.append("bf16/fp16 optimizer states need the precision-aware optimizer, which runs only with the distributed optimizer (zero 1)")
        if layout.fp8_param_gather and not layout.fp8:
            out.append("--fp8-param-gather keeps the weights in FP8 and needs FP8 training (TransformerConfig: fp8_param needs fp8)")
        if layout.fp8_param_gather and layout.zero < 1:
            out.append("--fp8-param-gather needs the distributed optimizer (zero 1; validate_args asserts it)")
        if layout.cp > 1:
            if costs.seq_len and costs.seq_len % (2 * layout.cp):
                out.append(f"context parallelism needs the sequence length ({costs.seq_len}) to divide by 2 x cp = {2 * layout.cp}")
            if not costs.architecture:
                out.append("context parallelism needs the model file's architecture() (heads, query groups)")
        return out

    def allowed_cuts(self, costs: ModelCosts) -> np.ndarray:
        """Only between whole transformer layers; the embedding stays with the first layer, the final norm,
        output layer and loss with the last, so the first and last stages always hold a layer."""
        return whole_block_cuts(costs)

    def runtime_schedule_problems(self, schedule: str, pp: int, m: int, v: int, group: int = 0) -> list[str]:
        out = super().runtime_schedule_problems(schedule, pp, m, v, group)
        if schedule == "interleaved" and group:
            # forward_backward_pipelining_with_interleaving (core_v0.16.1): the group lies in [p, m], and a last group
            # of 0 < m % group < p micro-batches is refused (the rest of the rule is the schedule's own)
            if group < pp:
                out.append(f"Megatron's micro-batch group size must lie in [p, m] = [{pp}, {m}], got {group}")
        elif schedule == "interleaved":
            if m % pp != 0:
                out.append(f"Megatron interleaved 1F1B needs m to be a multiple of p ({pp}), got m={m}")
            if m < pp:
                out.append(f"Megatron interleaved 1F1B needs m >= p ({pp}), got m={m}")
        return out

    def interleaved_groups(self, pp: int, m: int) -> tuple[int, ...]:
        """The default group (p) when p divides m; otherwise the smallest group Megatron accepts (a group in [p, m]
        whose last group is empty or holds at least p), which interleaves an m that is not a multiple of p."""
        if m % pp == 0 or m < pp:
            return (0,)
        return next(((g,) for g in range(pp, m + 1) if not group_constraints("interleaved", pp, m, g)), (0,))

    def tensor_parallel_problems(self, costs: ModelCosts, tp: int) -> list[str]:
        if tp == 1:
            return []
        arch = costs.architecture or {}
        if not arch:
            return ["tensor parallelism needs the model file's architecture() (heads, query groups)"]
        return tensor_parallel_problems(arch, tp)

    def architecture_problem(self, arch: dict[str, Any] | None, model: str) -> tuple[str, str] | None:
        return architecture_problem(arch, model)

    def architecture_from_config(self, config: Any, causal: bool, seq_len: int | None) -> tuple[dict[str, Any] | None, str | None]:
        return _architecture_from_config(config, causal, seq_len)


def _architecture_from_config(config: Any, causal: bool, seq_len: int | None) -> tuple[dict[str, Any] | None, str | None]:
    """Megatron's GPT shape of a transformers causal LM (planner.engines.megatron.hf_shapes), or why there is none."""
    if not seq_len:
        return None, "no sequence length (the model's first input is not a batch of token ids)"
    gap = hf_architecture_gap(config, seq_len)
    if gap is None and not causal:
        gap = f"{type(config).__name__} is not a causal language model's config (Megatron's GPT model has an output layer over the vocabulary)"
    return (hf_architecture(config, seq_len) if gap is None else None), gap


def _upgrade_layout(d: dict[str, Any]) -> dict[str, Any]:
    """A Megatron layout of a plan written before the overlaps were fields: the gradient reduce overlapped (and was
    rendered) whenever there was a data-parallel group or a distributed optimizer."""
    if "overlap_grad_reduce" in d:
        return d
    return {**d, "overlap_grad_reduce": d.get("dp", 1) > 1 or d.get("zero", 0) >= 1}


LAYOUT_UPGRADES["megatron"] = _upgrade_layout

ENGINE = MegatronEngine()
