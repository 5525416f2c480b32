"""torchtitan (``torchrun -m torchtitan.train --module llama3 --config ...`` with CLI overrides).

Facts (torchtitan 0.3.0 sources):
* Pipeline stages are torch.distributed.pipelining ``PipelineStage`` modules run by the schedule class
  ``get_schedule_class(parallelism.pipeline_parallel_schedule)`` returns
  (distributed/pipeline_parallel.py ``_build_pipeline_schedule``), so the torch engine's schedule rules apply;
  :data:`SCHEDULE_NAMES` maps ours to the names torch looks up. ZBVZeroBubble and DualPipeV place stages
  in a V (``_get_pp_rank_to_stage_indices_mapping``), every other schedule in a loop.
* Stages are lists of whole modules (``parallelism.module_fqns_per_model_part``; ``_split_module`` keeps the
  listed children and sets the others to None): for Llama ``tok_embeddings``, ``layers.N``, ``norm`` and
  ``lm_head``. Cuts are therefore only between whole transformer layers; we keep the embedding with the first
  layer and norm + output layer with the last (:func:`planner.engines.base.whole_block_cuts`).
* Data parallelism is always FSDP2: models/llama3/parallelize.py calls ``apply_fsdp_to_decoder`` even at
  shard degree 1 ("with shard_degree=1 it is a no-op for the all-gather but still installs the
  MixedPrecisionPolicy"), with ``MixedPrecisionPolicy(param_dtype=training.mixed_precision_param (bfloat16),
  reduce_dtype=training.mixed_precision_reduce (float32))`` (distributed/fsdp.py ``apply_fsdp_to_decoder``).
  Our ZeRO 0 is ``data_parallel_replicate_degree = dp`` (replicated, fp32 all-reduce); ZeRO 3 is
  ``data_parallel_shard_degree = dp`` (weights, gradients and AdamW moments sharded).
* State per parameter: fp32 sharded parameters (the master copy) 4, fp32 gradients 4, AdamW moments 8. With
  pipeline parallelism ``get_fsdp_reshard_after_forward_policy("default", pp_enabled=True)`` is False, and
  torch's ``PipelineStage.backward_maybe_with_nosync`` (torch/distributed/pipelining/stage.py, torch 2.13)
  calls ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)`` on every backward but
  the last, so each rank holds its stages' unsharded bf16 parameters (2 bytes) and, from FSDP2's
  ``FSDPParam.to_accumulated_grad_if_needed``, unsharded gradients accumulated in the fp32 reduce dtype
  (4 bytes) through the step: 6 bytes per parameter that no sharding divides.
* The parameter all-gather moves bf16 (param_dtype) and gradients are reduced in fp32 (reduce_dtype). The
  recipe books the fp32 parameter as 2 bytes of weight (what the search all-gathers) plus 2 of master (both
  sharded alike), so memory and communication bytes are both exact. Neither exchange is assumed overlapped
  with compute (FSDP2's prefetch is not modelled).
* Tensor parallelism (``parallelism.tensor_parallel_degree``; models/llama3/sharding.py): wq/wk/wv and w1/w3
  column-parallel, wo and w2 row-parallel, with ``parallelism.enable_sequence_parallel`` (default True) the norms
  sequence-parallel and wo/w2 reduce-scattering, as Megatron's sequence parallelism shards them (the generic
  ``shard_costs``). Planned with full activation checkpointing only: a block then keeps its (sequence-sharded) input,
  and its recompute rebuilds the block once, where DTensor's column-parallel linears keep their all-gathered inputs
  (:func:`tp_gathered_inputs`). Under op-level or no checkpointing those gathered inputs stay saved for every block
  and torchtitan's policy saves the reduce-scatter outputs: not modelled, so refused.
* Async TP is ``compile.enable_async_tensor_parallel``, which torchtitan's CompileConfig refuses without
  ``compile.enable`` and "model" among the compiled components (config/configs.py CompileConfig.__post_init__); it is
  priced as Megatron's overlapped TP collectives (Layout.tp_comm_overlap).
* torch.compile (``compile.enable``; ``compile.components`` model and, by default, loss) is rendered where asked
  (Layout.compile, Settings.model.compile_loss). Time: each compiled block's memory-bound operators as inductor fuses
  them (planner.model.cost._Fusion, planner.solve.timing.compiled_traffic), the Float8 casts fused
  (:data:`TORCHAO_COMPILED_CAST_BYTES_PER_ELEMENT`). Memory: a compiled loss keeps no fp32 tensors
  (planner.engines.torchtitan.loss); the blocks' saved set is priced as eager (what inductor's partitioner saves
  instead is not modelled).
* Float8 (``--dtype fp8``): torchtitan 0.3.0 turns it on in the model spec, not on the command line
  (``Float8LinearConverter`` in ``model_registry(..., converters=[...])``, components/quantization/float8.py; recipes
  ``rowwise`` (default) and ``rowwise_with_gw_hp``), so the renderer writes a config_registry module. torchao 0.18's
  ``Float8Linear`` (torchao/float8/float8_linear.py ``matmul_with_hp_or_float8_args``) casts dynamically each call
  and ``save_for_backward(input_hp, weight_hp_t)``: the saved activations stay bf16 and no FP8 weight copy persists;
  FP8 all-gather of FSDP weights is tensorwise-only (torchao/float8/config.py) so with rowwise the all-gather stays
  bf16. Each linear casts its input and weight forward and, backward, its output gradient twice (one per scaling
  axis), its weight and its saved input again: :func:`float8_cast_bytes`. Like torchtitan's 405B recipe the output
  layer stays bf16 (``filter_fqns=["lm_head"]``), so only the transformer blocks' GEMMs run at the FP8 peak.
* Context parallelism (``parallelism.context_parallel_degree``): 0.3.0's llama3 attends with FlexAttention (the
  registry's ``attn_backend="flex"``), whose CP wrapper all-gathers each rank's keys and values over the CP group
  before attention (distributed/context_parallel/api.py ``apply_cp_to_forward``: ``flex_cp_allgather``), the
  sequence load-balanced over the ranks; earlier releases ran SDPA's ring with the ``allgather`` rotate method by
  default. Both are the all-gather exchange (Layout.cp_comm ``all_gather``): exposed before attention, the gathered
  keys and values (and their gradients) held while it runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from planner.engines.base import whole_block_cuts
from planner.engines.pipelining import PipeliningEngine
from planner.engines.torchtitan.checkpointing import block_ranges, checkpointed, selective_work
from planner.engines.torchtitan.loss import LOSS_CHUNKS, chunked_loss
from planner.records import DEFAULT_LOSS, LossRun, ModelCosts, RecomputeWork
from planner.solve.memory import DTYPE_BYTES, OPTIMIZER_STATE_BYTES, StateRecipe, state_recipe
from planner.solve.plan import Layout

#: our schedule name -> the name torchtitan passes to torch's get_schedule_class
SCHEDULE_NAMES: dict[str, str] = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved": "Interleaved1F1B",
    "looped-bfs": "LoopedBFS",
    "zb-h1": "InterleavedZeroBubble",
    "interleaved-zb": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}

#: bytes per element an eager torchao dynamic Float8 cast moves: the amax pass reads the bf16 tensor (2), the scale
#: and cast pass reads it again (2) and writes the FP8 tensor (1) (torchao/float8/float8_scaling_utils.py
#: hp_tensor_to_float8_dynamic: tensor_to_scale, then hp_tensor_and_scale_to_float8; rowwise scales are one fp32 per row)
TORCHAO_CAST_BYTES_PER_ELEMENT = 5.0
#: the same cast compiled: inductor computes the rowwise amax and the scaled cast in one kernel (a row reduction
#: followed by pointwise work on the same row), which reads the bf16 tensor once (2) and writes the FP8 one (1)
TORCHAO_COMPILED_CAST_BYTES_PER_ELEMENT = 3.0


def float8_linears(arch: Mapping[str, object], kind: str, tp: int) -> list[tuple[float, float]]:
    """(input features, output features) per GPU of each Float8Linear of a torchtitan Llama piece: wq, wk, wv, wo in
    attention (separate linears, each casting its own copy of the input), w1, w3, w2 in the MLP (w1, w2 ungated)."""
    h = float(arch["hidden_size"])  # type: ignore[arg-type]
    heads = float(arch["num_attention_heads"])  # type: ignore[arg-type]
    kv = h * float(arch.get("num_query_groups") or heads) / heads  # type: ignore[arg-type]
    gated = arch.get("activation") == "swiglu"
    ffn = float(arch.get("ffn_hidden_size") or (int(8 * h / 3 / 64) * 64 if gated else 4 * h))  # type: ignore[arg-type]
    attn = [(h, h / tp), (h, kv / tp), (h, kv / tp), (h / tp, h)]
    mlp = [(h, ffn / tp)] * (2 if gated else 1) + [(ffn / tp, h)]
    return {"attention": attn, "mlp": mlp, "block": attn + mlp}.get(kind, [])


def float8_cast_bytes(arch: Mapping[str, object], kind: str, tokens: float, tp: int, compiled: bool = False) -> tuple[list[float], list[float]]:
    """Bytes of each torchao Float8 cast of one piece for ``tokens`` tokens per GPU (forward, backward): per linear
    (k -> n) forward the input (tokens x k) and the weight (k x n); backward the output gradient for the input
    gradient and again along the other axis for the weight gradient (2 x tokens x n), the weight (k x n) and the saved
    bf16 input (tokens x k); :data:`TORCHAO_CAST_BYTES_PER_ELEMENT` each, or compiled
    :data:`TORCHAO_COMPILED_CAST_BYTES_PER_ELEMENT`."""
    c = TORCHAO_COMPILED_CAST_BYTES_PER_ELEMENT if compiled else TORCHAO_CAST_BYTES_PER_ELEMENT
    fwd: list[float] = []
    bwd: list[float] = []
    for k, n in float8_linears(arch, kind, tp):
        fwd += [c * tokens * k, c * k * n]
        bwd += [c * tokens * n, c * tokens * n, c * k * n, c * tokens * k]
    return fwd, bwd


def tp_gathered_inputs(costs: ModelCosts, tp: int, sequence_parallel: bool) -> ModelCosts:
    """``costs`` with each transformer block's working set grown by what DTensor's column-parallel linears keep under
    sequence parallelism while the block runs: the all-gathered inputs of attention and of the MLP (each the block's
    input at full sequence, tp x its sharded bytes), less the sharded copies the generic sharding counted."""
    if tp == 1 or not sequence_parallel:
        return costs
    layers = list(costs.layers)
    for a, b in block_ranges(costs):
        extra = 2 * costs.cuts[a].bytes * (tp - 1)
        for i in range(a, b):
            layers[i] = replace(layers[i], max_op_bytes=int(layers[i].max_op_bytes + extra))
    return replace(costs, layers=tuple(layers))


#: bytes per parameter of the unsharded copies FSDP2 keeps through a pipelined step: bf16 parameters
#: (reshard_after_forward False) + fp32 accumulated gradients (gradient sync off until the last backward)
PP_UNSHARDED_BYTES = DTYPE_BYTES["bf16"] + DTYPE_BYTES["fp32"]


class TorchtitanEngine(PipeliningEngine):
    name = "torchtitan"
    title = "torchtitan"
    description = "torchtitan torchtitan.train (torch.distributed.pipelining schedules, FSDP2 data parallelism)"
    schedules = tuple(SCHEDULE_NAMES)
    searched_schedules = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
    zero_levels = (0, 3)
    sub_block_cuts = False
    tensor_parallel = True
    context_parallel = True
    #: FlexAttention's CP all-gathers keys and values (module docstring)
    cp_comm_types = ("all_gather",)
    #: async TP (compile.enable_async_tensor_parallel), by the Layout field Megatron's --tp-comm-overlap sets
    overlaps = ("tp-comm-overlap",)
    compiles = True
    loss_chunks = True
    overlap_needs_compile = True
    #: async TP's symmetric-memory workspace, one per group: the fused all-gather-matmul asks for one rank's shard, the
    #: fused matmul-reduce-scatter for two of its output chunks (torch 2.13 torch/distributed/_symmetric_memory
    #: ``_pipelined_all_gather_and_consume``: the shard's bytes; ``_pipelined_produce_and_all2all``: 2 x one chunk), so
    #: the workspace holds two of one rank's (s / tp x b x h) bf16 shards
    tp_overlap_shard_buffers = 2.0
    fp8 = True
    #: torchtitan 0.3.0's activation checkpointing policies the planner prices (planner.engines.torchtitan.checkpointing):
    #: selective is its per-op SAC, the Trainer's default
    recompute_modes = ("none", "selective", "full")
    checkpoints_itself = True
    #: the loss is torchtitan's ChunkedLossWrapper on the last stage, which sends nothing on: its working set is
    #: layer_activations' (planner.engines.torchtitan.loss)
    model_io_buffers = False
    own_loss = "torchtitan's own cross-entropy of the next token (torchtitan builds the model from its model registry; the model file's loss does not run)"

    def state_recipe(self, precision: str, zero: int, optimizer: str = "adam", layout: Layout | None = None) -> StateRecipe:
        if precision not in ("bf16", "fp32"):  # torchtitan's mixed_precision_param is bfloat16 or float32
            return state_recipe(precision, optimizer, zero=zero)
        sharded = zero >= 3
        pipelined = layout is not None and layout.pp > 1
        copies = (PP_UNSHARDED_BYTES if precision == "bf16" else 2 * DTYPE_BYTES["fp32"]) if pipelined else 0.0
        gathered = DTYPE_BYTES["bf16"] if precision == "bf16" else DTYPE_BYTES["fp32"]
        master = DTYPE_BYTES["fp32"] - gathered
        return StateRecipe(gathered, 4.0, master, OPTIMIZER_STATE_BYTES[optimizer], sharded, sharded, sharded, copy_bytes=copies)

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
        """What torchtitan's activation checkpointing keeps of each traced piece (:func:`checkpointed`), with the
        all-gathered inputs of its tensor-parallel linears in a block's working set (:func:`tp_gathered_inputs`).
        Float8Linear saves its bf16 input, so no GEMM input is kept in FP8 (the FP8 saved-input terms are zeroed)."""
        costs = replace(costs, layers=tuple(replace(l, gemm_saved_bytes=0, gemm_shared_bytes=0) for l in costs.layers))
        return chunked_loss(tp_gathered_inputs(checkpointed(costs, recompute), tp, sequence_parallel), loss.chunks or LOSS_CHUNKS, loss.compiled)

    def fp8_cast_bytes(self, arch: Mapping[str, object], kind: str, tokens: float, tp: int, compiled: bool = False) -> tuple[list[float], list[float]]:
        """torchao's dynamic Float8 casts (:func:`float8_cast_bytes`), fused when the blocks are compiled."""
        return float8_cast_bytes(arch, kind, tokens, tp, compiled)

    def tensor_parallel_problems(self, costs: ModelCosts, tp: int) -> list[str]:
        """torchtitan's Llama shards whole heads: query and key/value heads divide by tp (models/common/attention.py)."""
        if tp == 1:
            return []
        arch = costs.architecture or {}
        if not arch:
            return ["tensor parallelism needs the model file's architecture() (heads, key/value heads)"]
        heads = int(arch["num_attention_heads"])
        kv = int(arch.get("num_query_groups") or heads)
        return [
            f"torchtitan's tensor parallelism splits whole heads: {what} ({n}) must divide by tp ({tp})"
            for what, n in (("attention heads", heads), ("key/value heads", kv))
            if n % tp
        ]

    def layout_problems(self, layout: Layout, costs: ModelCosts) -> list[str]:
        out = super().layout_problems(layout, costs)
        if layout.tp > 1 and layout.recompute != "full":
            out.append(
                f"torchtitan's tensor parallelism is planned with full activation checkpointing only (got {layout.recompute}): "
                "without it DTensor's column-parallel linears keep their all-gathered inputs and the op-level policy the "
                "reduce-scatter outputs, which the planner does not model"
            )
        return out

    def recompute_work(self, costs: ModelCosts, tp: int, sequence_parallel: bool, cp: int, modules: frozenset[str]) -> tuple[RecomputeWork, ...] | None:
        """SelectiveAC's recomputed matmuls and memory-bound operators (:func:`selective_work`)."""
        return selective_work(costs)

    def selective_applies(self, costs: ModelCosts) -> bool:
        return any(l.block is not None and l.compute_op_names for l in costs.layers)

    def recomputes_attention_core(self, modules: frozenset[str]) -> bool:
        return False  # SelectiveAC keeps the attention op's output

    def sends_output_copies(self, schedule: str) -> bool:
        return False  # torchtitan's stages are its own modules, not the rendered copying stages of the torch engine

    def allowed_cuts(self, costs: ModelCosts) -> np.ndarray:
        return whole_block_cuts(costs)

    def runtime_schedule_problems(self, schedule: str, pp: int, m: int, v: int, group: int = 0) -> list[str]:
        out = super().runtime_schedule_problems(schedule, pp, m, v, group)
        if schedule in ("gpipe", "1f1b") and v != 1:
            out.append(f"torchtitan's {SCHEDULE_NAMES[schedule]} is a single-stage schedule: exactly 1 stage per rank, got {v}")
        return out


ENGINE = TorchtitanEngine()
