"""Per-piece time of one micro-batch: an analytical roofline, or measured times where a profile has them.

For each piece, on one GPU of a tensor-parallel group of size ``tp``:

    forward   = matmul_time(FLOPs / tp) + memory_time(bytes moved by other operators / tp) + tp collectives
    backward  = the same for the backward's FLOPs and bytes, split into the input-gradient part (I)
                and the weight-gradient part (W) by their FLOPs
    recompute = full: the whole forward again before the backward; selective: the attention core's forward

``matmul_time`` divides FLOPs by the device's dense peak times its achievable
matmul efficiency at the piece's mean operator size; ``memory_time`` divides
bytes by memory bandwidth times its achievable fraction (planner.hardware).

Tensor parallelism (Megatron style, with sequence parallelism) splits a
transformer piece's matmuls and, with sequence parallelism, its other
operators and saved activations over ``tp`` GPUs, and adds per attention or
MLP piece one all-gather + reduce-scatter of the residual stream forward and
one backward (each pair moves what one all-reduce moves: Korthikanti et al.
2022, section 4.2.2); the vocabulary-parallel embedding and head add one
all-reduce (embedding forward, head backward). These collectives are on the
critical path, so they add to the piece's time, unless the layout overlaps them.

With Megatron's ``--tp-comm-overlap`` (Transformer Engine userbuffers, sequence
parallelism required) each all-gather / reduce-scatter is split into ``tp``
chunks pipelined with the GEMM that consumes or produces them: the GEMM hides
the transfer except the one chunk that starts (or ends) the ring, so a piece
exposes ``max(collectives / tp, collectives - its matmul time)``
(:func:`overlapped_collective_time`). The backward overlaps the same way
(TE's bulk overlap of the dgrad and wgrad GEMMs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planner import hardware
from planner.hardware import Cluster, DeviceProfile
from planner.records import Layer, ModelCosts, RecomputeWork, evolve, map_layers, scale_layer
from planner.solve.mesh import Mesh

TP_COLLECTIVES = {"attention": (1, 1), "mlp": (1, 1), "block": (2, 2), "embedding": (1, 0), "head": (0, 1)}

#: an all-gather + reduce-scatter pair of sequence parallelism costs this many ring all-reduces: Calculon's A100
#: system (calculon-ai/calculon systems/a100_80g.json) prices reduce_scatter and all_gather at 1.5 each against
#: all_reduce's 2.0 on NVLink, i.e. the pair at 1.5 all-reduces (NCCL's RS/AG reach a lower bus bandwidth than its AR)
SP_PAIR_ALLREDUCES = 1.5


#: the pieces whose GEMMs Transformer Engine runs in FP8 under Megatron's --fp8-format: the transformer layers' linear
#: layers. The output layer is megatron.core.tensor_parallel.ColumnParallelLinear, not a TE module, and stays in the
#: training dtype (megatron/core/models/gpt/gpt_model.py, core_r0.8.0 and core_v0.16.1); the embedding has no GEMM.
FP8_GEMM_KINDS = ("attention", "mlp", "block")
#: the piece kinds that hold an attention layer (a fused attention kernel leaves no score tensor for the cost meter to
#: see, so a piece's kind tells where the context-parallel exchanges run)
ATTENTION_KINDS = ("attention", "block")
#: bytes per element a Transformer Engine FP8 cast moves on Hopper: it reads the bf16 tensor (2) and writes the FP8 copy
#: (1) and its FP8 transpose (1), which the wgrad / dgrad GEMMs need since Hopper's FP8 GEMMs take only the TN layout
#: (transformer_engine/pytorch/module/linear.py: cast_transpose of the input forward and of the output gradient
#: backward; amax is reduced inside the same kernel, the scale update is one per step for all tensors)
FP8_CAST_BYTES_PER_ELEMENT = 4.0


def fp8_gemm_shapes(arch: Mapping[str, object], kind: str, tp: int, ffn_hidden: float | None = None) -> list[tuple[float, float]]:
    """(input features, output features) per GPU of each linear layer of a transformer piece under tensor parallelism
    ``tp``: QKV (h -> (q + 2 kv) / tp) and projection (q / tp -> h) in attention, FC1 (h -> ffn (x 2 gated) / tp) and
    FC2 (ffn / tp -> h) in the MLP; both for a whole block. ``ffn_hidden`` replaces the architecture's MLP width (a
    MoE layer's shared experts)."""
    h = float(arch["hidden_size"])  # type: ignore[arg-type]
    heads = float(arch["num_attention_heads"])  # type: ignore[arg-type]
    kv = h * float(arch.get("num_query_groups") or heads) / heads  # type: ignore[arg-type]
    gated = arch.get("activation") == "swiglu"
    ffn = ffn_hidden or arch.get("ffn_hidden_size") or (int(8 * h / 3 / 64) * 64 if gated else 4 * h)
    attn = [(h, (h + 2 * kv) / tp), (h / tp, h)]
    mlp = [(h, float(ffn) * (2 if gated else 1) / tp), (float(ffn) / tp, h)]  # type: ignore[arg-type]
    return {"attention": attn, "mlp": mlp, "block": attn + mlp}.get(kind, [])


def fp8_cast_bytes(arch: Mapping[str, object], kind: str, tokens: float, tp: int, ffn_hidden: float | None = None) -> tuple[list[float], list[float]]:
    """Bytes of each FP8 cast kernel of one piece for ``tokens`` tokens per GPU (forward, backward): every linear
    layer's input forward and its output gradient backward, :data:`FP8_CAST_BYTES_PER_ELEMENT` each. Counted unfused
    (TE fuses the QKV and FC1 input casts into the preceding norm, which then writes 1 FP8 byte in place of 2 bf16
    ones: an over-count of at most 1 byte per element of those two inputs). ``ffn_hidden``: as :func:`fp8_gemm_shapes`."""
    shapes = fp8_gemm_shapes(arch, kind, tp, ffn_hidden)
    fwd = [FP8_CAST_BYTES_PER_ELEMENT * tokens * k for k, _ in shapes]
    bwd = [FP8_CAST_BYTES_PER_ELEMENT * tokens * n for _, n in shapes]
    return fwd, bwd


def moe_fp8_cast_bytes(arch: Mapping[str, object], kind: str, tokens: float, tp: int, rows: float, etp: int = 1) -> tuple[list[float], list[float]]:
    """Bytes of each FP8 cast kernel of a mixture-of-experts piece (forward, backward): its shared experts' MLP (and
    its attention, for a whole block) as :func:`fp8_cast_bytes` at their own width, and the routed experts' grouped
    GEMMs over the ``rows`` token-expert pairs the GPU routes (before the expert-TP all-gather).

    The routed experts are Transformer Engine GroupedLinear layers (megatron/core/transformer/moe/experts.py
    TEGroupedMLP, core_v0.16.1), which under FP8 quantize each GEMM's input forward and its output gradient backward
    as a linear layer does: FC1 reads the etp x rows gathered rows at the full width h and writes (2 x, gated)
    moe_ffn / etp; FC2 reads moe_ffn / etp and writes h. So forward 4 x rows x (etp x h + moe_ffn) bytes, backward
    4 x rows x (etp x h + 2 moe_ffn) (gated), at :data:`FP8_CAST_BYTES_PER_ELEMENT`. A MoE piece has no dense MLP of
    the architecture's ``ffn_hidden_size`` to cast."""
    shared = arch.get("moe_shared_expert_intermediate_size")
    dense_kind = kind if shared or kind != "block" else "attention"
    width = float(shared) if shared else None  # type: ignore[arg-type]
    fwd, bwd = fp8_cast_bytes(arch, dense_kind, tokens, tp, width) if shared or kind == "block" else ([], [])
    ffn = arch.get("moe_ffn_hidden_size")
    if rows > 0 and ffn:
        h = float(arch["hidden_size"])  # type: ignore[arg-type]
        f = float(ffn)  # type: ignore[arg-type]
        gate = 2.0 if arch.get("activation") == "swiglu" else 1.0
        c = FP8_CAST_BYTES_PER_ELEMENT * rows
        fwd = fwd + [c * etp * h, c * f]
        bwd = bwd + [c * etp * h, c * gate * f]
    return fwd, bwd


def attention_core_flops(arch: Mapping[str, object], kind: str, seq_len: float, tokens: float, tp: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of the attention core (softmax(QK^T)V) of one piece on one GPU, as the costing counts
    the fused attention kernel: 4 x tokens x seq_len x q / tp forward (q = hidden: the query heads' width) and 2.5x that
    backward (torch's FlopCounterMode formulas for scaled_dot_product_attention). Transformer Engine keeps it in bf16
    under FP8 unless FP8 attention is asked for (TransformerConfig.fp8_dot_product_attention, False by default:
    megatron/core/transformer/transformer_config.py, core_v0.16.1); 0 for pieces without one."""
    if kind not in ("attention", "block"):
        return 0.0, 0.0
    fwd = 4.0 * tokens * seq_len * float(arch["hidden_size"]) / tp  # type: ignore[arg-type]
    return fwd, 2.5 * fwd


def overlapped_collective_time(coll_s: float, matmul_s: float, tp: int) -> float:
    """Seconds of ``coll_s`` of tensor-parallel collectives a piece still exposes when they overlap ``matmul_s`` of
    its GEMMs, split into ``tp`` chunks: at least one chunk (coll_s / tp), and whatever the GEMMs are too short to hide."""
    if coll_s <= 0 or tp <= 1:
        return max(0.0, coll_s)
    return max(coll_s / tp, coll_s - matmul_s)


def overlapped_dispatch_time(a2a_s: float, attn_fwd_s: float, attn_bwd_s: float, mlp_fwd_s: float, mlp_bwd_s: float) -> tuple[float, float]:
    """(forward, backward) seconds of an MoE layer's four all-to-alls (dispatch and combine, forward and backward,
    ``a2a_s`` each) still exposed under Megatron's --overlap-moe-expert-parallel-comm, given the computation of the
    layer's attention and MoE MLP (without the all-to-alls), forward and backward.

    Megatron-LM core_v0.16.1 (models/common/model_chunk_schedule_plan.py ``TransformerLayerSchedulePlan.run``, driven by
    pipeline_parallel/combined_1f1b.py) runs the forward of one micro-batch and the backward of another layer by layer,
    the all-to-alls on a communication stream against the other's computation in three phases::

        comm:  combine_bwd | dispatch_fwd -> dispatch_bwd | combine_fwd
        comp:  attn_fwd    | mlp_bwd -> mlp_dw -> mlp_fwd | attn_bwd

    so what stays exposed is max(0, a2a - attn_fwd) + max(0, 2 a2a - mlp_fwd - mlp_bwd) + max(0, a2a - attn_bwd): the
    combine's backward is charged to the backward, its forward to the forward, the middle phase half to each. This is
    a paired pass; the warm-up forwards and cool-down backwards that have no partner expose their two all-to-alls in
    full (:func:`paired_share`). A piece holding attention and experts together gives attention 0 (all in the middle)."""
    mid = max(0.0, 2 * a2a_s - mlp_fwd_s - mlp_bwd_s)
    return max(0.0, a2a_s - attn_bwd_s) + mid / 2, max(0.0, a2a_s - attn_fwd_s) + mid / 2


def paired_share(pp: int, vp: int, m: int, group: int) -> float:
    """The share of a rank's forward (and backward) passes that the combined 1F1B schedule of Megatron-LM core_v0.16.1
    pairs with another micro-batch's, averaged over the pp ranks: without pipelining all but the first forward and the
    last backward of the m micro-batches (combined_1f1b_schedule_for_no_pipelining: phases 1 ... m - 1); interleaved,
    the m x vp chunk passes less the warm-up forwards, 2 (pp - 1 - r) + (vp - 1) x ``group`` + 1 on rank r (one more
    than the interleaved schedule's: schedules.py get_pp_rank_microbatches with the overlap), and as many cool-down
    backwards."""
    if pp <= 1:
        return max(0.0, (m - 1) / m) if m > 0 else 0.0
    total = m * vp
    warm = [min(total, 2 * (pp - 1 - r) + (vp - 1) * group + 1) for r in range(pp)]
    return sum((total - x) / total for x in warm) / pp


def tp_collective_time(cluster: Cluster, nbytes: float, ranks: Sequence[int], sequence_parallel: bool = True) -> float:
    """Seconds of one tensor-parallel collective on the residual stream of ``nbytes`` (unsharded) over ``ranks``:
    an all-gather + reduce-scatter pair with sequence parallelism, else an all-reduce."""
    t = cluster.allreduce_time(nbytes, ranks)
    return float(t * SP_PAIR_ALLREDUCES if sequence_parallel else t)


def expert_gemm_time(op_flops: Sequence[float], num_experts: int, ep: int, split: int, device: DeviceProfile, dtype: str, floor_s: float = 0.0) -> float:
    """Seconds one GPU spends in a piece's routed-expert grouped GEMMs at balanced routing.

    ``op_flops`` are the grouped GEMMs over all routed rows of the (context-split) micro-batch. A GPU starts
    with 1/``split`` of the tokens (sequence parallelism: split = tp), the all-to-all gives it the rows of its
    num_experts / ep local experts from the ep GPUs of its expert group, and with expert tensor parallelism
    etp it all-gathers etp times the rows for 1/etp of each expert's width: either way each GEMM x of the list
    becomes num_experts / ep GEMMs of x x ep / (split x num_experts) FLOPs, each rated by its own size (the
    grouped GEMM of Megatron-LM core_v0.16 megatron/core/transformer/moe/experts.py runs one GEMM per local
    expert). Small experts make small GEMMs: what makes many fine-grained experts slow."""
    if num_experts <= 0 or not op_flops:
        return 0.0
    # the repeated layers of a model ask the same question for every candidate layout: answered once per device
    key = (tuple(op_flops), num_experts, ep, split, id(device), dtype, floor_s)
    hit = _EXPERT_GEMM.get(key)
    if hit is not None and hit[0] is device:
        return hit[1]
    local = max(1, num_experts // ep)
    f = ep / (split * num_experts)
    t = sum(local * max(floor_s, hardware.matmul_time(x * f, device, dtype)) for x in op_flops if x > 0)
    if len(_EXPERT_GEMM) >= 1 << 16:
        _EXPERT_GEMM.clear()
    _EXPERT_GEMM[key] = (device, t)  # the entry keeps its device alive, so an identity is never reused while remembered
    return t


#: expert_gemm_time's answers by its arguments (the device by identity, with the device kept)
_EXPERT_GEMM: dict[tuple[object, ...], tuple[DeviceProfile, float]] = {}


def expert_dispatch_time(cluster: Cluster, nbytes: float, first_rank: int, ep: int, etp: int) -> float:
    """Seconds of one token dispatch (or combine) of an MoE layer for the GPU group starting at ``first_rank``:
    the all-to-all of ``nbytes`` (the rows one GPU routes) over the ep GPUs of its expert-parallel group, then
    with etp > 1 the all-gather (combine: reduce-scatter) of those rows over the etp GPUs of its expert
    tensor-parallel group.

    Megatron-LM core_v0.16 megatron/core/transformer/moe/token_dispatcher.py (MoEAlltoAllTokenDispatcher):
    permute -> A2A(EP) -> AG(expert TP) before the experts, RS(expert TP) -> A2A(EP) -> unpermute after;
    the expert rank order tp-ep-dp (parallel_state.py) puts an expert group's ep GPUs etp ranks apart."""
    if nbytes <= 0 or ep * etp <= 1:
        return 0.0
    experts = Mesh(ep=ep, etp=etp)
    t = cluster.all_to_all_time(nbytes, experts.expert_parallel_group(first_rank)) if ep > 1 else 0.0
    if etp > 1:
        t += cluster.all_gather_time(nbytes * etp, experts.expert_tensor_group(first_rank))
    return float(t)


#: bytes per routed row of the router's probabilities the dispatcher sends with the rows: TopKRouter returns them in
#: the logits' dtype (megatron/core/transformer/moe/router.py, core_v0.16.1: softmax in fp32, then ``type_as(logits)``;
#: the logits are in the input dtype unless --moe-router-dtype asks for fp32), bf16 in a bf16 / FP8 run
MOE_PROBS_BYTES_PER_ROW = 2.0
#: bytes per expert of the token counts each GPU all-gathers before its dispatch (int64 ``routing_map.sum(0).long()``)
MOE_COUNT_BYTES_PER_EXPERT = 8.0


def moe_dispatcher_terms(
    cluster: Cluster, device: DeviceProfile, routed_rows: float, routed_bytes: float, num_experts: int, first_rank: int, ep: int, etp: int, floor_s: float = 0.0
) -> tuple[float, float]:
    """(forward, backward) seconds of the all-to-all token dispatcher's work around its dispatch and combine that the
    costed model itself does not do, per MoE layer and micro-batch, for ``routed_rows`` rows of ``routed_bytes`` a GPU
    routes (MoEAlltoAllTokenDispatcher, megatron/core/transformer/moe/token_dispatcher.py, core_v0.16.1, dropless):

    * permutation 2: with more than one local expert (num_experts / ep > 1) the rows received from the ep (x etp)
      GPUs are re-sorted by local expert (``sort_chunks_by_idxs`` in dispatch_postprocess) and sorted back before the
      combine (combine_preprocess): one copy of the etp x rows each (read and write, 2 x etp x routed_bytes), and
      one each in the backward (the gradient of the split-and-concatenate is another concatenation);
    * the probabilities' all-to-all (``all_to_all(ep_group, permuted_probs, ...)`` next to the rows' one, and its
      backward): :func:`expert_dispatch_time` of rows x :data:`MOE_PROBS_BYTES_PER_ROW`;
    * with ep x etp > 1, ``preprocess`` all-gathers every GPU's per-expert token counts over the expert tensor and
      expert parallel group (``gather_from_sequence_parallel_region(..., group=tp_ep_group)``) before the dispatch:
      a small all-gather, all latency;
    * the host synchronisation before the all-to-all (``_maybe_dtoh_and_synchronize``: the split sizes are copied to
      the host and the CPU waits on that copy's event before it can issue the all-to-all, so the GPU's queue drains):
      one per layer forward (the backward reuses the host's split sizes), priced as the device profile's
      synchronisation figure of a pipeline send/recv (``p2p_sync_s``: Megatron synchronises the device after each
      batched pipeline send/recv the same way), 0 where the profile has none.

    The first permutation and the unpermutation (moe_utils.permute / unpermute: the gather of each token's k rows,
    the scatter-add back weighted by the probabilities), the router's softmax / top-k and the probabilities'
    multiply are operators of the costed model (examples/moe.py runs them) and are in its memory-bound bytes."""
    if num_experts <= 0 or routed_rows <= 0:
        return 0.0, 0.0
    fwd = device.p2p_sync_s
    bwd = 0.0
    if num_experts // max(1, ep) > 1:
        copy = 2.0 * etp * routed_bytes
        t = max(floor_s, hardware.memory_time(copy, device, bytes_per_op=copy))
        fwd += 2 * t
        bwd += 2 * t
    if ep * etp > 1:
        probs = expert_dispatch_time(cluster, routed_rows * MOE_PROBS_BYTES_PER_ROW, first_rank, ep, etp)
        fwd += probs + cluster.all_gather_time(MOE_COUNT_BYTES_PER_EXPERT * num_experts * ep * etp, list(range(first_rank, first_rank + ep * etp)))
        bwd += probs
    return float(fwd), float(bwd)


@dataclass(frozen=True)
class PieceTimes:
    """Seconds per micro-batch for each piece: forward, backward-input, backward-weight, and the recompute added to backward."""

    fwd: tuple[float, ...]
    bwd_input: tuple[float, ...]
    bwd_weight: tuple[float, ...]
    recompute: tuple[float, ...]
    source: tuple[str, ...]  # "analytical" | "measured" per piece

    @property
    def total(self) -> tuple[float, ...]:
        return tuple(f + i + w + r for f, i, w, r in zip(self.fwd, self.bwd_input, self.bwd_weight, self.recompute))


def shard_costs(costs: ModelCosts, tp: int, sequence_parallel: bool = True, classes: Sequence[int] | None = None) -> ModelCosts:
    """The costs one GPU of a tensor-parallel group of ``tp`` sees (parameters are split later, in memory.stage_params).

    Matmul FLOPs, the attention core (heads) and the operators between the column- and
    row-parallel matmuls divide by ``tp`` in the pieces tensor parallelism splits; the
    operators on the residual stream (norms, residual adds, dropout), the saved
    activations and the tensors sent between stages divide by ``tp`` only with sequence
    parallelism. ``classes``: records.map_layers.
    """
    if tp == 1:
        return costs
    act = tp if sequence_parallel else 1
    cuts = tuple(evolve(c, tensors=tuple(evolve(t, bytes=int(t.bytes / act)) for t in c.tensors)) for c in costs.cuts)
    return evolve(costs, layers=map_layers(costs.layers, lambda l: _shard_layer(l, tp, act), classes), cuts=cuts)


def _shard_layer(l: Layer, tp: int, act: int) -> Layer:
    """One piece as :func:`shard_costs` shards it (``act``: tp with sequence parallelism, else 1)."""
    shard = l.kind in TP_COLLECTIVES or l.shardable_params > 0
    heads = tp if shard else act
    # the fused regions mix both kinds of operators: scaled as the operators they fuse are, in total
    eager_f, eager_b = sum(l.op_bytes_fwd) + sum(l.op_bytes_fwd_resid), sum(l.op_bytes_bwd) + sum(l.op_bytes_bwd_resid)
    fused_f = (sum(l.op_bytes_fwd) / heads + sum(l.op_bytes_fwd_resid) / act) / eager_f if eager_f else 1.0 / act
    fused_b = (sum(l.op_bytes_bwd) / heads + sum(l.op_bytes_bwd_resid) / act) / eager_b if eager_b else 1.0 / act
    return evolve(
        l,
        flops_fwd=l.flops_fwd / (tp if shard else 1),
        flops_bwd=l.flops_bwd / (tp if shard else 1),
        flops_bwd_weight=l.flops_bwd_weight / (tp if shard else 1),
        op_flops_fwd=tuple(x / (tp if shard else 1) for x in l.op_flops_fwd),
        op_flops_bwd=tuple(x / (tp if shard else 1) for x in l.op_flops_bwd),
        core_flops_fwd=l.core_flops_fwd / heads,
        op_flops_core=tuple(x / heads for x in l.op_flops_core),
        core_bytes_fwd=l.core_bytes_fwd / heads,
        op_bytes_core=tuple(x / heads for x in l.op_bytes_core),
        core_saved_bytes=int(l.core_saved_bytes / heads),
        saved_bytes=int((l.saved_bytes - l.core_saved_bytes) / act + l.core_saved_bytes / heads),
        gemm_saved_bytes=int(l.gemm_saved_bytes / act),
        gemm_shared_bytes=int(l.gemm_shared_bytes / act),
        mem_bytes_fwd=sum(l.op_bytes_fwd) / heads + sum(l.op_bytes_fwd_resid) / act,
        mem_bytes_bwd=sum(l.op_bytes_bwd) / heads + sum(l.op_bytes_bwd_resid) / act,
        op_bytes_fwd=tuple(x / heads for x in l.op_bytes_fwd),
        op_bytes_bwd=tuple(x / heads for x in l.op_bytes_bwd),
        op_bytes_fwd_resid=tuple(x / act for x in l.op_bytes_fwd_resid),
        op_bytes_bwd_resid=tuple(x / act for x in l.op_bytes_bwd_resid),
        fused_bytes_fwd=tuple(x * fused_f for x in l.fused_bytes_fwd),
        fused_bytes_bwd=tuple(x * fused_b for x in l.fused_bytes_bwd),
        max_op_bytes=int(l.max_op_bytes / act),
        out_bytes=int(l.out_bytes / act),
    )


def compiled_traffic(costs: ModelCosts, loss: bool = False) -> ModelCosts:
    """``costs`` with the memory-bound work of the transformer blocks as torch.compile runs it: each piece's fused
    regions (Layer.fused_bytes_*, one kernel each) in place of its eager operators. torchtitan compiles each block
    (``apply_compile``: ``torch.compile(block, fullgraph=True)``) and, with "loss" among the compile components, the
    loss on its own (``_maybe_compile``), which the output-layer piece after the last block holds (``loss``); the
    embedding, the final norm and the output layer's matmul stay eager. Pieces costed before the fused regions were
    recorded (none) keep their eager operators."""
    last_block = max((k for k, l in enumerate(costs.layers) if l.block is not None), default=-1)
    layers = []
    for k, l in enumerate(costs.layers):
        fuse = l.block is not None or (loss and k > last_block and l.kind == "head")
        if fuse and (l.fused_bytes_fwd or l.fused_bytes_bwd):
            l = evolve(
                l,
                op_bytes_fwd=l.fused_bytes_fwd,
                op_bytes_bwd=l.fused_bytes_bwd,
                op_bytes_fwd_resid=(),
                op_bytes_bwd_resid=(),
                mem_bytes_fwd=float(sum(l.fused_bytes_fwd)),
                mem_bytes_bwd=float(sum(l.fused_bytes_bwd)),
            )
        layers.append(l)
    return evolve(costs, layers=tuple(layers))


def split_context(costs: ModelCosts, cp: int, classes: Sequence[int] | None = None) -> ModelCosts:
    """The costs one GPU of a context-parallel group of ``cp`` sees: every per-token quantity (FLOPs, bytes moved,
    saved activations, stage-boundary tensors) divided by ``cp``; parameters unchanged.

    Megatron splits each sequence into 2 x cp chunks and gives rank i chunks i and 2cp - 1 - i, so each
    rank does 1/cp of the causal attention work as well as of the token-wise work. ``classes``: records.map_layers.
    """
    if cp == 1:
        return costs
    f = 1.0 / cp
    layers = map_layers(costs.layers, lambda l: scale_layer(l, f), classes)
    cuts = tuple(evolve(c, tensors=tuple(evolve(t, bytes=int(round(t.bytes * f))) for t in c.tensors)) for c in costs.cuts)
    return evolve(costs, layers=layers, cuts=cuts)


def kv_bytes(costs: ModelCosts, tp: int, cp: int) -> float:
    """Bytes of one rank's key and value block for the costed micro-batch: 2 x (s / cp) x b x kv_hidden / tp x 2 bytes
    (bf16), kv_hidden = hidden x query_groups / heads; 0 without an architecture."""
    arch = costs.architecture or {}
    if not arch or not costs.seq_len:
        return 0.0
    heads = float(arch["num_attention_heads"])
    kv_hidden = float(arch["hidden_size"]) * float(arch.get("num_query_groups") or heads) / heads
    return 2.0 * costs.seq_len / cp * costs.micro_batch * kv_hidden / tp * 2.0


def q_bytes(costs: ModelCosts, tp: int, cp: int) -> float:
    """Bytes of one rank's query block (also its attention output's) for the costed micro-batch: (s / cp) x b x
    hidden / tp x 2 bytes (bf16); 0 without an architecture."""
    arch = costs.architecture or {}
    if not arch or not costs.seq_len:
        return 0.0
    return costs.seq_len / cp * costs.micro_batch * float(arch["hidden_size"]) / tp * 2.0


def cp_exchange_exposed(cluster: Cluster, comm: str, q_block: float, kv_block: float, ranks: Sequence[int]) -> tuple[float, float]:
    """(forward, backward) seconds an attention piece waits for the context-parallel exchange of the types that do not
    overlap it (Transformer Engine 2.x attention/dot_product_attention/context_parallel.py), for one rank's query
    block ``q_block`` and key + value block ``kv_block`` bytes over the cp GPUs ``ranks``:

    * ``all_gather`` (AttnFuncWithCPAndKVAllGather, "KV all-gather between CP ranks is exposed"): forward all-gathers
      K and V (gather_along_first_dim, one collective each); backward gathers them again, then reduce-scatters dK and dV.
    * ``a2a`` (AttnFuncWithCPAndQKVOA2A, DeepSpeed-Ulysses): forward all-to-alls Q, K and V before attention
      (heads scattered, sequence gathered) and the output after; backward the output gradient before and dQ, dK, dV
      after; each all_to_all_single moves its whole tensor, and attention waits for them.

    ``p2p`` (the ring, overlapped block by block) is :func:`ring_attention_exposed`; 0, 0 here."""
    if len(ranks) <= 1 or comm == "p2p":
        return 0.0, 0.0
    half = kv_block / 2.0  # K and V travel as separate tensors
    if comm == "all_gather":
        n = len(ranks)
        gather = 2 * cluster.all_gather_time(n * half, ranks)
        return gather, gather + 2 * cluster.reduce_scatter_time(n * half, ranks)
    if comm == "a2a":
        one = 2 * cluster.all_to_all_time(q_block, ranks) + 2 * cluster.all_to_all_time(half, ranks)
        return one, one
    raise ValueError(f"unknown context-parallel exchange {comm!r}")


def ring_attention_exposed(step_comm_s: float, core_s: float, cp: int) -> tuple[float, float]:
    """(forward, backward) seconds of ring attention's KV exchange a piece exposes.

    The causal attention of a rank is done in ``cp`` block steps of ``core_s / cp`` each; each of the
    cp - 1 transfers of the next KV block (``step_comm_s``) overlaps one step. The backward passes KV
    and their gradients (twice the bytes) against twice the compute.
    """
    if cp <= 1:
        return 0.0, 0.0
    a = core_s / cp
    return (cp - 1) * max(0.0, step_comm_s - a), (cp - 1) * max(0.0, 2 * step_comm_s - 2 * a)


def analytical_times(
    costs: ModelCosts,
    device: DeviceProfile,
    dtype: str,
    recompute: str = "none",
    tp: int = 1,
    tp_collective_time: float | Sequence[float] = 0.0,
    tp_overlap: bool = False,
    matmul_dtype: str | None = None,
    kernel_floor_s: float = 0.0,
    cp: int = 1,
    cp_step_s: float = 0.0,
    experts: tuple[int, int, float | Sequence[float]] = (1, 1, 0.0),
    cast_bytes: Sequence[tuple[Sequence[float], Sequence[float]]] | None = None,
    kept_flops: Sequence[tuple[float, float]] | None = None,
    dispatcher_terms: Sequence[tuple[float, float]] | None = None,
    ep_overlap: float = 0.0,
    recompute_work: Sequence[RecomputeWork] | None = None,
    recompute_core: bool = True,
    host_op_s: float = 0.0,
    cp_exposed: tuple[float, float] | None = None,
    fused_core_flops: Sequence[float] | None = None,
    classes: Sequence[int] | None = None,
) -> PieceTimes:
    """Roofline times of every piece (``costs`` already sharded with :func:`shard_costs`).

    ``tp_collective_time`` is the seconds of one residual-stream collective over
    the tensor-parallel group, per piece or one value for all (0 when tp == 1);
    ``tp_overlap`` hides them behind the piece's GEMMs (:func:`overlapped_collective_time`).
    ``matmul_dtype`` rates the GEMMs at another peak than ``dtype`` (``"fp8"``: Transformer
    Engine FP8 GEMMs, while the other operators move ``dtype`` bytes). ``kernel_floor_s`` is
    the least time one operator takes (the device's back-to-back kernel issue time).
    ``cp_step_s`` is one KV-block transfer around the context-parallel ring of ``cp`` GPUs,
    overlapped with the attention core (:func:`ring_attention_exposed`).
    ``experts`` is (ep, split, dispatch seconds per piece or one value): the routed experts' GEMMs of each
    piece timed per local expert (:func:`expert_gemm_time`, the GPU holding 1/split of the tokens), and two
    dispatches (dispatch and combine, :func:`expert_dispatch_time`) forward and two backward on the critical
    path (Megatron core_v0.16 overlaps them only with --overlap-moe-expert-parallel-comm, off by default).
    With ``matmul_dtype`` only the pieces of :data:`FP8_GEMM_KINDS` run their GEMMs at it, and ``cast_bytes``
    (per piece: forward and backward bytes of each cast kernel, :func:`fp8_cast_bytes`) adds their casts as
    memory-bound operators; ``kept_flops`` (per piece: forward and backward FLOPs, :func:`attention_core_flops`) are
    the FLOPs of those pieces that stay at ``dtype``'s rate (the attention core). ``dispatcher_terms`` (per piece:
    forward and backward seconds, :func:`moe_dispatcher_terms`) add the token dispatcher's own work to the MoE pieces.
    ``ep_overlap`` (Megatron's --overlap-moe-expert-parallel-comm) is the share of the forward and backward passes
    that run paired with another micro-batch's (:func:`paired_share`): in those the dispatch and combine hide behind
    its computation of the same layer (:func:`overlapped_dispatch_time`), the others expose them.
    Selective recomputation recomputes the attention core (``recompute_core``; off when the engine was told other
    modules only) and, per piece, ``recompute_work`` (the engine's recomputed modules: GEMMs at the piece's GEMM
    rate, memory-bound kernels, and their residual-stream collectives).
    ``host_op_s`` is the host's time to issue one operator (:func:`issued_operators`): a piece's forward takes at
    least its forward operators x ``host_op_s`` and its backward its backward operators x ``host_op_s``
    (:func:`host_bound`), the GPU running no faster than the host hands it work.
    ``cp_exposed`` is the (forward, backward) seconds each attention piece waits for a context-parallel exchange that
    does not overlap it (:func:`cp_exchange_exposed`: all-gather, all-to-all); None prices the ring (``cp_step_s``).
    ``fused_core_flops`` (per piece, forward) is the attention core of pieces whose fused kernel the cost meter cannot
    tell from other work (:func:`attention_core_flops`): the compute the ring's transfers hide behind.
    ``classes`` (records.piece_classes of ``costs.layers``) lets a piece whose costs and per-piece inputs equal an
    earlier piece's take that piece's times instead of working them out again (the same numbers).
    """
    mm_dtype = matmul_dtype or dtype
    n = len(costs.layers)
    coll = [float(tp_collective_time)] * n if isinstance(tp_collective_time, (int, float)) else list(tp_collective_time)

    ep, split, dispatch = experts
    a2a = [float(dispatch)] * n if isinstance(dispatch, (int, float)) else list(dispatch)

    fwd: list[float] = []
    bi: list[float] = []
    bw: list[float] = []
    rc: list[float] = []
    done: dict[tuple[object, ...], tuple[float, float, float, float]] = {}
    for k, l in enumerate(costs.layers):
        before = (fwd[-1], bi[-1] + bw[-1]) if ep_overlap and k > 0 and l.block is not None and costs.layers[k - 1].block == l.block else (0.0, 0.0)
        if classes is not None:
            # everything below reads of piece k: its costs (its class), ``before`` and the k-th entry of each per-piece input
            same = (
                classes[k],
                before,
                coll[k],
                a2a[k],
                None if kept_flops is None else tuple(kept_flops[k]),
                None if cast_bytes is None else (tuple(cast_bytes[k][0]), tuple(cast_bytes[k][1])),
                None if dispatcher_terms is None else tuple(dispatcher_terms[k]),
                None if recompute_work is None else recompute_work[k],
                None if fused_core_flops is None else fused_core_flops[k],
            )
            hit = done.get(same)
            if hit is not None:
                fwd.append(hit[0])
                bi.append(hit[1])
                bw.append(hit[2])
                rc.append(hit[3])
                continue
        gemm_dtype = mm_dtype if matmul_dtype is None or l.kind in FP8_GEMM_KINDS else dtype
        dense_f = 0.0 if l.expert_op_flops_fwd and not l.op_flops_fwd else l.flops_fwd
        dense_b = 0.0 if l.expert_op_flops_bwd and not l.op_flops_bwd else l.flops_bwd
        mm_f = ops_time(l.op_flops_fwd, dense_f, device, gemm_dtype, kernel_floor_s)
        mm_b = ops_time(l.op_flops_bwd, dense_b, device, gemm_dtype, kernel_floor_s)
        if l.expert_op_flops_fwd:
            mm_f += expert_gemm_time(l.expert_op_flops_fwd, l.num_experts, ep, split, device, gemm_dtype, kernel_floor_s)
            mm_b += expert_gemm_time(l.expert_op_flops_bwd, l.num_experts, ep, split, device, gemm_dtype, kernel_floor_s)
        w_share = l.flops_bwd_weight / l.flops_bwd if l.flops_bwd > 0 else 0.0
        f = mm_f + bytes_time(l.op_bytes_fwd + l.op_bytes_fwd_resid, l.mem_bytes_fwd, device, kernel_floor_s)
        w = mm_b * w_share
        i = mm_b * (1.0 - w_share) + bytes_time(l.op_bytes_bwd + l.op_bytes_bwd_resid, l.mem_bytes_bwd, device, kernel_floor_s)
        if kept_flops is not None and gemm_dtype != dtype:
            keep_f, keep_b = kept_flops[k]
            f += hardware.matmul_time(keep_f, device, dtype) - hardware.matmul_time(keep_f, device, gemm_dtype)
            i += hardware.matmul_time(keep_b, device, dtype) - hardware.matmul_time(keep_b, device, gemm_dtype)  # input-gradient work
        if cast_bytes is not None and gemm_dtype != dtype:
            cast_f, cast_b = cast_bytes[k]
            f += sum(max(kernel_floor_s, hardware.memory_time(x, device, bytes_per_op=x)) for x in cast_f)
            i += sum(max(kernel_floor_s, hardware.memory_time(x, device, bytes_per_op=x)) for x in cast_b)
        n_f, n_b = TP_COLLECTIVES.get(l.kind, (0, 0)) if tp > 1 else (0, 0)
        if l.num_experts and l.shardable_params == 0:
            # routed experts alone: the dispatcher works on the GPU's 1/tp of the tokens (its expert-TP gather is in
            # the dispatch time); only shared experts, a tensor-parallel MLP, gather and scatter the residual stream
            n_f = n_b = 0
        if tp_overlap:
            f += overlapped_collective_time(n_f * coll[k], mm_f, tp)
            i += overlapped_collective_time(n_b * coll[k], mm_b, tp)
        else:
            f += n_f * coll[k]
            i += n_b * coll[k]
        if l.num_experts and a2a[k] > 0 and ep_overlap:  # hidden behind the layer's work of another micro-batch
            f_exp, b_exp = overlapped_dispatch_time(a2a[k], before[0], before[1], f, i + w)
            f += ep_overlap * f_exp + (1.0 - ep_overlap) * 2 * a2a[k]
            i += ep_overlap * b_exp + (1.0 - ep_overlap) * 2 * a2a[k]
        elif l.num_experts and a2a[k] > 0:  # dispatch + combine, forward and backward
            f += 2 * a2a[k]
            i += 2 * a2a[k]
        if l.num_experts and dispatcher_terms is not None:
            f += dispatcher_terms[k][0]
            i += dispatcher_terms[k][1]
        if cp > 1 and cp_exposed is not None and (l.core_flops_fwd > 0 or l.kind in ATTENTION_KINDS):
            f += cp_exposed[0]  # an exchange attention waits for, whatever its kernel
            i += cp_exposed[1]
        elif cp > 1 and (l.core_flops_fwd > 0 or (fused_core_flops is not None and fused_core_flops[k] > 0)):
            if l.core_flops_fwd > 0:
                core = ops_time(l.op_flops_core, l.core_flops_fwd, device, dtype, kernel_floor_s) + bytes_time(
                    l.op_bytes_core, l.core_bytes_fwd, device, kernel_floor_s
                )
            else:  # a fused kernel (flash attention): its FLOPs by the closed form, at the matmul rate of their size
                core = hardware.matmul_time(fused_core_flops[k], device, dtype)  # type: ignore[index]
            ring_f, ring_b = ring_attention_exposed(cp_step_s, core, cp)
            f += ring_f
            i += ring_b
        if recompute == "full":
            r = f
        elif recompute == "selective":
            r = 0.0
            if recompute_core:
                r = ops_time(l.op_flops_core, l.core_flops_fwd, device, dtype, kernel_floor_s) + bytes_time(
                    l.op_bytes_core, l.core_bytes_fwd, device, kernel_floor_s
                )
            if recompute_work is not None and (recompute_work[k].gemm_flops or recompute_work[k].kernel_bytes):
                rw = recompute_work[k]
                mm_r = ops_time(rw.gemm_flops, sum(rw.gemm_flops), device, gemm_dtype, kernel_floor_s)
                r += mm_r + bytes_time(rw.kernel_bytes, sum(rw.kernel_bytes), device, kernel_floor_s)
                r += overlapped_collective_time(rw.collectives * coll[k], mm_r, tp) if tp_overlap else rw.collectives * coll[k]
        else:
            r = 0.0
        if host_op_s > 0:
            n_fwd, n_bwd = issued_operators(l, ep, len(cast_bytes[k][0]) if cast_bytes is not None and gemm_dtype != dtype else 0)
            f, i, w = host_bound(f, i, w, n_fwd * host_op_s, n_bwd * host_op_s)
            r = f if recompute == "full" else r
        fwd.append(f)
        bi.append(i)
        bw.append(w)
        rc.append(r)
        if classes is not None:
            done[same] = (f, i, w, r)
    return PieceTimes(tuple(fwd), tuple(bi), tuple(bw), tuple(rc), ("analytical",) * n)


def issued_operators(layer: Layer, ep: int = 1, casts: int = 0) -> tuple[int, int]:
    """(forward, backward) operators the host issues for one piece and micro-batch: each operator the trace recorded
    (``op_flops_*``, ``op_bytes_*`` and ``op_bytes_*_resid``), each routed grouped GEMM once per local expert
    (num_experts / ``ep``: Transformer Engine's grouped GEMM issues one GEMM per expert, as :func:`expert_gemm_time`
    times it) and ``casts`` FP8 cast kernels forward and backward."""
    local = max(1, layer.num_experts // max(1, ep)) if layer.num_experts else 1
    fwd = len(layer.op_flops_fwd) + len(layer.op_bytes_fwd) + len(layer.op_bytes_fwd_resid) + local * len(layer.expert_op_flops_fwd)
    bwd = len(layer.op_flops_bwd) + len(layer.op_bytes_bwd) + len(layer.op_bytes_bwd_resid) + local * len(layer.expert_op_flops_bwd)
    return fwd + casts, bwd + casts


def host_bound(fwd: float, bwd_input: float, bwd_weight: float, host_fwd: float, host_bwd: float) -> tuple[float, float, float]:
    """A pass's seconds when the host needs ``host_fwd`` / ``host_bwd`` seconds to issue its operators: the forward
    takes max(fwd, host_fwd); a backward shorter than host_bwd is stretched to it, its input- and weight-gradient
    parts in their own proportion (all to the input gradient where the backward has no time of its own)."""
    fwd = max(fwd, host_fwd)
    bwd = bwd_input + bwd_weight
    if bwd < host_bwd:
        if bwd > 0:
            bwd_input, bwd_weight = bwd_input * host_bwd / bwd, bwd_weight * host_bwd / bwd
        else:
            bwd_input = host_bwd
    return fwd, bwd_input, bwd_weight


def ops_time(op_flops: Sequence[float], total: float, device: DeviceProfile, dtype: str, floor_s: float = 0.0) -> float:
    """Seconds for a piece's matmul-like operators, each rated by its own size and taking at least ``floor_s``;
    ``total`` FLOPs when no list is known."""
    if not op_flops:
        return hardware.matmul_time(total, device, dtype)
    key = ("ops", id(device), dtype, floor_s, tuple(op_flops))
    hit = _OP_TIMES.get(key)
    if hit is None or hit[0] is not device:
        hit = (device, sum(max(floor_s, hardware.matmul_time(x, device, dtype)) for x in op_flops if x > 0))
        _remember(key, hit)
    return hit[1]


def bytes_time(op_bytes: Sequence[float], total: float, device: DeviceProfile, floor_s: float = 0.0) -> float:
    """Seconds for a piece's memory-bound operators, each rated by its transfer size and taking at least ``floor_s``;
    ``total`` bytes when no list is known."""
    if not op_bytes:
        return hardware.memory_time(total, device)
    key = ("bytes", id(device), floor_s, tuple(op_bytes))
    hit = _OP_TIMES.get(key)
    if hit is None or hit[0] is not device:
        hit = (device, sum(max(floor_s, hardware.memory_time(x, device, bytes_per_op=x)) for x in op_bytes))
        _remember(key, hit)
    return hit[1]


#: per-operator time sums already computed, by (kind, device identity, ..., operator sizes): the same pieces are timed
#: again for every recompute mode, overlap and (ep, etp) of a search; the device object is kept with the value so an
#: identity reused by another object never answers
_OP_TIMES: dict[tuple[object, ...], tuple[DeviceProfile, float]] = {}
_OP_TIMES_MAX = 1 << 16


def _remember(key: tuple[object, ...], value: tuple[DeviceProfile, float]) -> None:
    if len(_OP_TIMES) >= _OP_TIMES_MAX:
        _OP_TIMES.clear()
    _OP_TIMES[key] = value


def with_measured(times: PieceTimes, measured: Mapping[int, tuple[float, float]], recompute: str) -> PieceTimes:
    """Replace analytical times by measured (forward, backward) seconds for the pieces in ``measured``.

    The measured backward is split into input and weight parts in the
    analytical proportion; full recompute adds the measured forward.
    """
    fwd, bi, bw, rc = list(times.fwd), list(times.bwd_input), list(times.bwd_weight), list(times.recompute)
    src = list(times.source)
    for k, (f, b) in measured.items():
        total_b = bi[k] + bw[k]
        share = bw[k] / total_b if total_b > 0 else 0.5
        fwd[k], bw[k], bi[k] = f, b * share, b * (1 - share)
        if recompute == "full":
            rc[k] = f
        src[k] = "measured"
    return PieceTimes(tuple(fwd), tuple(bi), tuple(bw), tuple(rc), tuple(src))
