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
* No tensor or context parallelism in this engine (tensor_parallel_degree is rendered as 1): their cost model
  for torchtitan's DTensor plans is not verified.
"""

from __future__ import annotations

import numpy as np

from planner.engines.base import whole_block_cuts
from planner.engines.pipelining import PipeliningEngine
from planner.engines.torchtitan.checkpointing import checkpointed, selective_work
from planner.records import ModelCosts, RecomputeWork
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
    #: torchtitan 0.3.0's activation checkpointing policies the planner prices (planner.engines.torchtitan.checkpointing):
    #: selective is its per-op SAC, the Trainer's default
    recompute_modes = ("none", "selective", "full")
    checkpoints_itself = True
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
        self, costs: ModelCosts, tp: int, sequence_parallel: bool, cp: int, recompute: str, etp: int = 1, modules: frozenset[str] = frozenset()
    ) -> ModelCosts:
        """What torchtitan's activation checkpointing keeps of each traced piece (:func:`checkpointed`)."""
        return checkpointed(costs, recompute)

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
