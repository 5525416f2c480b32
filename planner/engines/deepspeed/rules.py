"""DeepSpeed's pipeline engine (PipelineModule + engine.train_batch()).

Facts (checked against DeepSpeed 0.19.8's sources; README "Engine rules"):
* PipelineEngine runs 1F1B only (its TrainSchedule), no virtual stages, no tensor
  parallelism of its own.
* It refuses ZeRO stage 2 or 3 with pipeline parallelism in ``PipelineEngine.__init__``
  ("ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"), after the
  optimizer is built, so a config asking for it passes DeepSpeedConfig and fails
  minutes into a launch.
* With bf16 it wraps the optimizer in BF16_Optimizer, which keeps an fp32 master
  copy and Adam moments partitioned over the data-parallel group and, with
  ``data_types.grad_accum_dtype = fp32``, fp32 gradient accumulation buffers.
* Any cut between our pieces is expressible (the rendered PipelineModule takes the
  planned boundaries).
* Mixtures of experts run as the model file writes them, at ep 1 (every data-parallel rank holds
  all experts). PipelineEngine can hold ``deepspeed.moe.layer.MoE`` with ep > 1 (since DeepSpeed
  PR #5338: ``deepspeed.utils.groups._create_expert_and_data_parallel`` draws the expert groups from each
  stage's data-parallel ranks), but only that layer: its own ``TopKGate`` (capacity factor, tokens
  dropped by default), experts as deep copies of one ``nn.Module`` (num_experts / ep per rank), and a gate loss
  ``l_aux`` the model must carry across stages to the loss (deepspeed/moe/layer.py,
  deepspeed/moe/sharded_moe.py). The rendered script runs the model file's own layers, so ep > 1
  is refused with that reason.
"""

from __future__ import annotations

import copy
from typing import Any

from planner.engines.base import Engine
from planner.solve.memory import StateRecipe, state_recipe
from planner.solve.plan import Layout


class DeepSpeedEngine(Engine):
    name = "deepspeed"
    description = "DeepSpeed PipelineModule + engine.train_batch() (1F1B, ZeRO <= 1)"
    schedules = ("1f1b",)
    searched_schedules = ("1f1b",)
    zero_levels = (0, 1)
    no_expert_parallel = (
        "its pipeline engine splits experts only inside deepspeed.moe.layer.MoE layers, with DeepSpeed's own top-k gate, capacity "
        "factor and token dropping; train_deepspeed.py runs the model file's MoE layers as they are, so ep and etp must be 1 "
        "(experts replicated over data parallelism)"
    )
    title = "DeepSpeed"
    recompute_hint = "activation recomputation (pipeline.activation_checkpoint_interval 1)"
    sharding_hint = "ZeRO stage 1"

    def state_recipe(self, precision: str, zero: int, optimizer: str = "adam", layout: Layout | None = None) -> StateRecipe:
        if precision == "bf16":
            # BF16_Optimizer partitions master and moments over dp at ZeRO 0 and 1; ZeRO 1 is rendered with
            # data_types.grad_accum_dtype = fp32 (4-byte gradients), ZeRO 0 accumulates in bf16 (2 bytes). The bf16
            # gradients themselves are freed after accumulation only because the rendered config sets
            # bf16.immediate_grad_update (measured: 6 bytes per parameter without it, 4 with it).
            return state_recipe(precision, optimizer, grad_bytes=4.0 if zero >= 1 else 2.0, zero=1)
        recipe = state_recipe(precision, optimizer, zero=zero)
        if precision == "fp32" and zero >= 1:
            # ZeRO-1 keeps an fp32 copy of each rank's partition even for fp32 models (stage_1_and_2.py)
            return StateRecipe(recipe.weight_bytes, recipe.grad_bytes, 4.0, recipe.optimizer_bytes, True, recipe.shard_grads, recipe.shard_weights)
        return recipe

    def blocking_sends(self, layout: Layout) -> bool:
        """The pipeline engine's sends block: deepspeed/runtime/pipe/p2p.py send() (DeepSpeed 0.19.8) refuses
        ``async_op`` and calls dist.send (or a broadcast over the two stages' group), and the engine runs its
        SendActivation / SendGrad instructions in order with the passes."""
        return True

    def searches_zero(self, zero: int, dtype: str, dp: int) -> bool:
        if dtype == "bf16":
            return zero != 0  # bf16 runs BF16_Optimizer either way; stage 1 adds fp32 gradient accumulation
        return super().searches_zero(zero, dtype, dp)

    def zero_problems(self, zero: int, pp: int) -> list[str]:
        if zero >= 2 and pp > 1:
            return [
                f"DeepSpeed refuses ZeRO stage {zero} with pipeline parallelism (PipelineEngine asserts "
                "'ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism' at start-up, after building the optimizer); use stage 0 or 1"
            ]
        return super().zero_problems(zero, pp)


def precision_config(config: dict[str, Any], precision: str) -> dict[str, Any]:
    """``config`` with the precision sections for ``precision`` (fp32, bf16 or fp16); other keys unchanged.

    bf16 at ZeRO >= 1 adds fp32 gradient accumulation; DeepSpeed refuses it at
    ZeRO 0 (``_do_optimizer_sanity_check``: NotImplementedError for a bf16
    model with fp32 accumulation and ZeRO off), where BF16_Optimizer
    accumulates in bf16.
    """
    cfg = copy.deepcopy(config)
    bf16 = cfg.pop("bf16", None) or {}
    fp16 = cfg.pop("fp16", None) or {}
    data_types = {k: v for k, v in (cfg.pop("data_types", None) or {}).items() if k != "grad_accum_dtype"}
    zero = int(cfg.get("zero_optimization", {}).get("stage", 0))
    if precision == "bf16":
        cfg["bf16"] = {"immediate_grad_update": True, **bf16, "enabled": True}
        if zero >= 1:
            data_types["grad_accum_dtype"] = "fp32"
    elif precision == "fp16":
        cfg["fp16"] = {**fp16, "enabled": True}
    elif precision != "fp32":
        raise ValueError(f"precision must be fp32, bf16 or fp16, got {precision!r}")
    if data_types:
        cfg["data_types"] = data_types
    return cfg


ENGINE = DeepSpeedEngine()
