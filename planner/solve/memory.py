"""Per-rank memory: model state, activations, buffers and runtime overhead (all in bytes).

Model state per parameter follows the engine's optimizer recipe (``StateRecipe``):
mixed-precision Adam keeps half-precision weights, gradients (half, or fp32
where the engine accumulates in fp32), an fp32 master copy and the two fp32
Adam moments: 2 + 2 + 12 = 16 bytes (Rajbhandari et al. 2019, arXiv
1910.02054), 18 with Megatron's fp32 main gradients, 6 + 12/d with its
distributed optimizer. ZeRO stage z partitions, over the data-parallel group,
the optimizer state (z >= 1), the gradients (z >= 2) and the weights (z = 3).

Activations per micro-batch come from the traced costs (bytes autograd
saves), reduced by recomputation:
* ``none``: every piece's saved bytes;
* ``selective``: the attention core's s x s tensors are recomputed, not kept
  (Korthikanti et al. 2022, arXiv 2205.05198);
* ``full``: each checkpointed unit (a transformer block, or a piece outside
  blocks) keeps only its input, as Megatron's ``--recompute-method uniform
  --recompute-num-layers 1`` and DeepSpeed's ``activation_checkpoint_interval=1``
  do; during backward one unit's activations are rebuilt at a time (the
  working set).
Under FP8 (Transformer Engine's linear layers in the transformer blocks) each weight GEMM keeps its input for the
weight gradient in FP8, 1 byte per element: the inputs only GEMMs keep shrink from 2 bytes to 1, and an input another
operator also keeps (the attention output, read by the projection) is kept twice, once in FP8
(:func:`saved_bytes`). The output layer is Megatron's own ColumnParallelLinear and stays bf16.
The schedule decides how many micro-batches' activations a rank holds at once
(the simulator's peak), so activation memory = bytes per micro-batch x held.

Runtime overhead (``RuntimeOverhead``): CUDA context and library workspaces,
communicator buffers, and a fragmentation reserve of the caching allocator,
with the sources of their defaults in their docstrings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.records import Layer, ModelCosts

GiB = 2**30


@dataclass(frozen=True)
class StateRecipe:
    """Bytes per parameter of each model-state tensor, and what ZeRO-style sharding applies.

    ``shard_optimizer``: master weights and optimizer moments are split over the
    data-parallel group (ZeRO-1, Megatron's distributed optimizer, DeepSpeed's
    BF16_Optimizer). ``shard_grads`` / ``shard_weights``: ZeRO-2 / ZeRO-3.
    """

    weight_bytes: float
    grad_bytes: float
    master_bytes: float
    optimizer_bytes: float
    shard_optimizer: bool = False
    shard_grads: bool = False
    shard_weights: bool = False
    #: copies of the weights in another dtype kept next to them, never sharded
    copy_bytes: float = 0.0
    #: bytes per parameter the FP8 GEMM weights (the Transformer Engine linear layers of the transformer blocks: see
    #: :func:`gemm_params`) take beyond ``weight_bytes``, never sharded: TE's cached FP8 copy and FP8 transpose of a
    #: bf16 weight (2); 0 with FP8 primary weights, whose FP8 weight and transpose take the bf16 weight's 2 bytes
    fp8_gemm_bytes: float = 0.0
    #: bytes per parameter the distributed optimizer all-gathers of those weights (None: ``weight_bytes``; 1 when
    #: they are FP8 primary weights, gathered in FP8)
    fp8_gemm_gather_bytes: float | None = None

    def per_param(self, dp: int) -> tuple[float, float, float]:
        """(weights, grads, optimizer) bytes per parameter for a data-parallel group of ``dp``."""
        w = self.weight_bytes / (dp if self.shard_weights else 1) + self.copy_bytes
        g = self.grad_bytes / (dp if self.shard_grads else 1)
        o = (self.master_bytes + self.optimizer_bytes) / (dp if self.shard_optimizer else 1)
        return w, g, o


OPTIMIZER_STATE_BYTES = {"adam": 8.0, "adamw": 8.0, "sgd": 4.0}  # fp32 moments per parameter (Adam: m and v; SGD: momentum)
#: bytes per element of the dtypes model state can be kept in
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
#: Transformer Engine FP8 GEMMs keep, per weight, an FP8 copy and (Hopper's FP8 GEMMs take only the TN layout)
#: its FP8 transpose, cached across the micro-batches of a step: 2 bytes per parameter besides the bf16 weight
FP8_WEIGHT_COPY_BYTES = 2.0
#: FP8 primary weights (Megatron --fp8-param-gather): the weight itself is FP8, 1 byte per parameter in the
#: distributed-data-parallel param buffer (megatron/core/distributed/distributed_data_parallel.py, core_v0.16.1: a
#: Float8Tensor parameter goes into a torch.uint8 buffer), and no bf16 weight is kept
FP8_PARAM_BYTES = 1.0
#: ... plus the FP8 transpose TE keeps next to an FP8 weight on Hopper (its FP8 GEMMs take only the TN layout, so the
#: backward's dgrad GEMM reads the transposed copy; Megatron's fp8_utils re-creates it after each param all-gather)
FP8_PARAM_TRANSPOSE_BYTES = 1.0
#: FP8 tensors of one TE linear layer with delayed scaling: input, weight, output (forward), two gradients (backward)
FP8_TENSORS_PER_GEMM = 5
#: GEMMs per transformer layer that run in FP8 (QKV, attention projection, FC1, FC2)
FP8_GEMMS_PER_LAYER = 4


def fp8_amax_bytes(layers: int, history: int) -> float:
    """Bytes of the delayed-scaling state of ``layers`` transformer layers: per FP8 tensor an fp32 amax history of
    ``history`` entries plus its scale and inverse scale."""
    return float(layers * FP8_GEMMS_PER_LAYER * FP8_TENSORS_PER_GEMM * (history + 2) * 4)


def state_recipe(
    precision: str,
    optimizer: str = "adam",
    grad_bytes: float | None = None,
    zero: int = 0,
    state_dtype: str = "fp32",
    fp8: bool = False,
    fp8_params: bool = False,
) -> StateRecipe:
    """The model-state recipe for a precision, optimizer and ZeRO stage.

    ``grad_bytes`` overrides the gradient element size (4 where the engine keeps
    fp32 gradients: Megatron's main grads, DeepSpeed's fp32 accumulation).
    ``state_dtype`` is the optimizer moments' dtype (fp32 unless a precision-aware
    optimizer keeps them in bf16 or fp16: Adam 2 x 2 bytes instead of 2 x 4).
    ``fp8`` adds the FP8 weight copies (:data:`FP8_WEIGHT_COPY_BYTES`) to the bf16 FP8 GEMM weights
    (``fp8_gemm_bytes``; embeddings, the output layer and norms stay bf16 without copies); with ``fp8_params`` (FP8
    primary weights) those weights are the FP8 tensor itself (:data:`FP8_PARAM_BYTES`) plus its transpose
    (:data:`FP8_PARAM_TRANSPOSE_BYTES`): 2 bytes per parameter in place of 2 + 2, gathered in 1. The fp32 master stays.
    """
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}")
    if state_dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown optimizer state dtype {state_dtype!r}")
    moments = OPTIMIZER_STATE_BYTES[optimizer] * DTYPE_BYTES[state_dtype] / 4.0
    if precision == "fp32":
        w, g, master = 4.0, 4.0, 0.0
    elif precision in ("bf16", "fp16"):
        w, g, master = 2.0, 2.0, 4.0
    else:
        raise ValueError(f"unknown precision {precision!r}")
    if grad_bytes is not None:
        g = float(grad_bytes)
    if fp8_params and not fp8:
        raise ValueError("FP8 primary weights need FP8 training")
    if fp8_params and precision == "fp32":
        raise ValueError("FP8 primary weights need a half-precision run (their master copy is fp32)")
    extra = FP8_WEIGHT_COPY_BYTES if fp8 else 0.0
    gather = None
    if fp8_params:
        extra, gather = FP8_PARAM_BYTES + FP8_PARAM_TRANSPOSE_BYTES - w, FP8_PARAM_BYTES
    return StateRecipe(w, g, master, moments, zero >= 1, zero >= 2, zero >= 3, fp8_gemm_bytes=extra, fp8_gemm_gather_bytes=gather)


@dataclass(frozen=True)
class RuntimeOverhead:
    """Memory a training process uses besides tensors it allocates (bytes).

    Defaults:
    * ``context``: 1.0 GiB for the CUDA context, cuBLAS/cuDNN workspaces and the
      kernels PyTorch loads (PyTorch's CUDA semantics notes: the context alone
      takes several hundred MiB depending on the CUDA version; cuBLAS keeps a
      workspace per stream, CUBLAS_WORKSPACE_CONFIG).
    * ``communicator``: 0.5 GiB for NCCL communicators (NCCL keeps
      NCCL_BUFFSIZE = 4 MiB per channel per peer; data-, tensor- and
      pipeline-parallel groups each have one).
    * ``fragmentation``: 5% of the transient bytes (activations saved for
      backward, the inputs a deferred weight-gradient pass still reads, the
      working set and the point-to-point buffers) is lost to fragmentation of
      the caching allocator in long training runs (PyTorch's
      memory notes describe the effect; `expandable_segments` reduces it). Only
      the tensors allocated and freed every micro-batch split and strand cached
      blocks; the model state (weights, gradient buffers, optimizer state, FP8
      weight copies) is allocated once and held for the whole run, each large
      tensor in a segment of its own rounded to 2 MiB (Megatron's gradient and
      parameter buffers are one allocation per dtype), so no reserve is charged
      on it.
    """

    context: float = 1.0 * GiB
    communicator: float = 0.5 * GiB
    fragmentation: float = 0.05


#: bytes per element of a GEMM input Transformer Engine keeps for the weight gradient under FP8 (its FP8 copy, or its
#: FP8 transpose): TE 1.x linear.py saves inputmat / inputmat_t in FP8, TE 2.x the quantized input with only the
#: column-wise usage the wgrad GEMM reads (NVIDIA/TransformerEngine transformer_engine/pytorch/module/linear.py)
FP8_SAVED_INPUT_BYTES = 1.0


def saved_bytes(layer: Layer, fp8: bool = False, dtype_bytes: float = 2.0) -> float:
    """Bytes one micro-batch leaves saved in ``layer`` until its backward. With ``fp8`` (a transformer-block piece):
    the GEMM inputs only weight GEMMs keep go from ``dtype_bytes`` to :data:`FP8_SAVED_INPUT_BYTES` per element, those
    another operator keeps too gain an FP8 copy."""
    if not (fp8 and layer.block is not None):
        return float(layer.saved_bytes)
    f = FP8_SAVED_INPUT_BYTES / dtype_bytes
    return float(layer.saved_bytes - layer.gemm_saved_bytes * (1.0 - f) + layer.gemm_shared_bytes * f)


def activation_bytes_per_microbatch(costs: ModelCosts, start: int, stop: int, recompute: str, fp8: bool = False) -> float:
    """Bytes one micro-batch leaves saved in pieces [start, stop) until its backward (per recompute mode)."""
    layers = costs.layers[start:stop]
    if recompute == "none":
        return float(sum(saved_bytes(l, fp8) for l in layers))
    if recompute == "selective":
        return float(sum(saved_bytes(l, fp8) - l.core_saved_bytes for l in layers))
    if recompute == "full":
        return float(sum(costs.cuts[k].bytes for k in checkpoint_starts(costs, start, stop)))
    raise ValueError(f"unknown recompute mode {recompute!r}")


def checkpoint_starts(costs: ModelCosts, start: int, stop: int) -> list[int]:
    """Cut indices where a checkpointed unit begins in [start, stop): the stage input, then every new block or non-block piece."""
    starts = [start]
    for k in range(start + 1, stop):
        blk = costs.layers[k].block
        if blk is None or blk != costs.layers[k - 1].block:
            starts.append(k)
    return starts


def piece_params(layer: Layer, tp: int = 1, ep: int = 1, etp: int = 1) -> float:
    """Parameters one GPU holds of a piece: shardable dense weights split over ``tp``, routed experts over
    ``ep`` x ``etp`` (Megatron's expert groups), the rest replicated."""
    dense = layer.params - layer.expert_params
    return layer.shardable_params / tp + (dense - layer.shardable_params) + layer.expert_params / (ep * etp)


def expert_params_per_gpu(costs: ModelCosts, start: int, stop: int, ep: int = 1, etp: int = 1) -> float:
    """Routed-expert parameters one GPU of a stage holds: the experts of pieces [start, stop) split over ep x etp."""
    return sum(l.expert_params for l in costs.layers[start:stop]) / (ep * etp)


def expert_range_params(costs: ModelCosts, ep: int, etp: int) -> np.ndarray:
    """Routed-expert parameters per GPU of every piece range [a, b), as an (n+1)^2 matrix (upper triangle)."""
    E = np.concatenate([[0.0], np.cumsum([l.expert_params / (ep * etp) for l in costs.layers])])
    return np.asarray(E[None, :] - E[:, None], dtype=float)


def stage_params(costs: ModelCosts, start: int, stop: int, tp: int = 1, ep: int = 1, etp: int = 1) -> float:
    """Parameters one rank of a stage holds: shardable weights split over ``tp``, experts over ep x etp, the rest
    replicated."""
    total = 0.0
    for l in costs.layers[start:stop]:
        total += piece_params(l, tp, ep, etp)
    # a weight shared by several pieces of the same stage is held once
    for g in costs.tied:
        inside = [i for i in g.layers if start <= i < stop]
        if len(inside) > 1:
            total -= g.params * (len(inside) - 1) / tp
    return total


def gemm_params(costs: ModelCosts, start: int, stop: int, tp: int = 1, ep: int = 1, etp: int = 1) -> float:
    """Parameters of the FP8 GEMM weights one rank of a stage holds: those of the transformer-block pieces
    (Transformer Engine's modules in Megatron's layer spec, experts' grouped GEMMs included; their norm weights and
    biases, a few per thousand, are counted with them), as :func:`stage_params` splits them. The embedding and the output
    layer are Megatron's own bf16 layers."""
    return float(sum(stage_params(costs, k, k + 1, tp, ep, etp) for k in range(start, stop) if costs.layers[k].block is not None))


def gemm_param_matrix(costs: ModelCosts, tp: int, ep: int = 1, etp: int = 1) -> np.ndarray:
    """:func:`gemm_params` of every piece range [a, b) as an (n+1)^2 matrix (upper triangle)."""
    per = [stage_params(costs, k, k + 1, tp, ep, etp) if l.block is not None else 0.0 for k, l in enumerate(costs.layers)]
    P = np.concatenate([[0.0], np.cumsum(per)])
    out: np.ndarray = P[None, :] - P[:, None]
    return out


def transient_matrix(costs: ModelCosts, recompute: str, fp8: bool = False, model_io: bool = True) -> np.ndarray:
    """Bytes allocated and freed while a stage of pieces [a, b) runs, as an (n+1)^2 matrix: the point-to-point buffers
    of its two boundaries (a send and a receive buffer each, 2 x (cut a + cut b)) and its working set (the largest
    operator output in the range, + one rebuilt unit under full recompute). ``model_io`` False: the model's input and
    output (cuts 0 and n) take no such pair (:attr:`planner.engines.base.Engine.model_io_buffers`).

    A GPU runs one stage's operator at a time, so a rank holding several stages (interleaved, ZB-V) needs the largest
    of its stages' transient bytes, not their sum (:func:`planner.solve.rank_memory.rank_need`).
    """
    n = costs.n
    L = costs.layers
    cut = np.array([c.bytes for c in costs.cuts], dtype=float)
    if not model_io:
        cut[0] = cut[n] = 0.0
    ws_piece = np.array([l.max_op_bytes for l in L], dtype=float)
    if recompute == "full":
        unit = np.zeros(n)
        starts = checkpoint_starts(costs, 0, n) + [n]
        for a, c in zip(starts, starts[1:]):
            unit[a:c] = sum(saved_bytes(l, fp8) for l in L[a:c])
        ws_piece = ws_piece + unit
    out: np.ndarray = 2.0 * (cut[:, None] + cut[None, :])
    for a in range(n):
        out[a, a + 1 :] += np.maximum.accumulate(ws_piece[a:])
    return out


def range_matrices(
    costs: ModelCosts, tp: int, recompute: str, fp8: bool = False, *, ep: int = 1, etp: int = 1, transient: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(parameters, other static bytes, activation bytes, pending-W bytes) of every piece range [a, b) as (n+1)^2 matrices.

    Other static bytes: buffers the pieces read, and the transient bytes of :func:`transient_matrix` (point-to-point
    buffers and the working set; ``transient``: that matrix, when the caller has it already). Only the upper triangle
    is meaningful. ``fp8``: saved bytes as Transformer Engine's FP8 linear layers keep them (:func:`saved_bytes`).
    """
    n = costs.n
    L = costs.layers
    prm = np.array([piece_params(l, tp, ep, etp) for l in L], dtype=float)
    P = np.concatenate([[0.0], np.cumsum(prm)])
    params = P[None, :] - P[:, None]
    for grp in costs.tied:  # a shared weight inside one stage is held once
        us = sorted(grp.layers)
        for x, y in zip(us, us[1:]):
            mask = np.zeros((n + 1, n + 1), dtype=bool)
            mask[: x + 1, y + 1 :] = True
            params -= mask * (grp.params / tp)
    cut = np.array([c.bytes for c in costs.cuts], dtype=float)
    buf = np.array([l.buffer_bytes for l in L], dtype=float)
    B = np.concatenate([[0.0], np.cumsum(buf)])
    other = B[None, :] - B[:, None] + (transient_matrix(costs, recompute, fp8) if transient is None else transient)
    # activations per micro-batch
    if recompute == "full":
        is_start = np.zeros(n + 1)
        for k in checkpoint_starts(costs, 0, n):
            is_start[k] = cut[k]
        U = np.concatenate([[0.0], np.cumsum(is_start[:n])])  # U[k] = sum of unit-start bytes before k
        act = cut[:, None] + (U[None, :] - U[np.minimum(np.arange(n + 1) + 1, n)][:, None])
        act = np.maximum(act, 0.0)
    else:
        saved = np.array([saved_bytes(l, fp8) - (l.core_saved_bytes if recompute == "selective" else 0) for l in L], dtype=float)
        A = np.concatenate([[0.0], np.cumsum(saved)])
        act = A[None, :] - A[:, None]
    wfrac = np.array([l.flops_bwd_weight / l.flops_bwd if l.flops_bwd > 0 else 0.0 for l in L])
    wsaved = np.array([saved_bytes(l, fp8) for l in L], dtype=float) * wfrac
    Wc = np.concatenate([[0.0], np.cumsum(wsaved)])
    wgrad = Wc[None, :] - Wc[:, None]
    return params, other, act, wgrad
