"""What each training engine can run: one place for the rules that search, render and validate share.

Facts (checked against the engines' sources; see README "Engine rules"):
* DeepSpeed's PipelineEngine runs 1F1B only (its TrainSchedule), no virtual
  stages, no tensor parallelism of its own; it refuses ZeRO stage 2 or 3 with
  pipeline parallelism in ``PipelineEngine.__init__`` ("ZeRO-2 and ZeRO-3 are
  incompatible with pipeline parallelism"), after the optimizer is built, so a
  config asking for it passes DeepSpeedConfig and fails minutes into a launch.
  With bf16 it wraps the optimizer in BF16_Optimizer, which keeps an fp32 master
  copy and Adam moments partitioned over the data-parallel group and, with
  ``data_types.grad_accum_dtype = fp32``, fp32 gradient accumulation buffers.
  Any cut between our pieces is expressible (the rendered PipelineModule takes
  the planned boundaries).
* Megatron-LM builds its own GPT blocks, so stages can only be cut between
  whole transformer layers, with the final norm, output layer and loss on the
  last stage; it runs 1F1B or interleaved 1F1B (virtual stages), tensor and
  sequence parallelism, the distributed optimizer (6 + 12/d bytes per
  parameter) and fp32 main gradients (18 bytes per parameter without it).
  Interleaving needs the number of micro-batches to be a multiple of pp and at
  least pp (in core_v0.16.1 point-to-point overlap is on by default, so pp = 2
  interleaves too; only ``--no-overlap-p2p-communication`` needs pp > 2).
* torch.distributed.pipelining (``torch``) runs GPipe, 1F1B, Interleaved1F1B,
  InterleavedZeroBubble and ZBVZeroBubble over PipelineStage modules, so any
  cut is expressible; 1F1B needs micro-batches >= stages, interleaved schedules
  need the micro-batch count to be a multiple of max(1, m // pp), ZBV exactly
  2 stages per rank (planner.solve.schedules.schedule_constraints holds the
  schedule rules of every engine).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import UsageError, did_you_mean
from planner.solve.memory import OPTIMIZER_STATE_BYTES, StateRecipe, state_recipe
from planner.solve.schedules import schedule_constraints, schedules_for_engine


@dataclass(frozen=True)
class EngineRules:
    name: str
    zero_levels: tuple[int, ...]
    tensor_parallel: bool
    sub_block_cuts: bool
    description: str
    recompute_modes: tuple[str, ...] = ("none", "full")

    @property
    def schedules(self) -> tuple[str, ...]:
        """The schedules this engine runs (planner.solve.schedules.SCHEDULE_INFO)."""
        return schedules_for_engine(self.name)


ENGINES: dict[str, EngineRules] = {
    "deepspeed": EngineRules(
        "deepspeed",
        zero_levels=(0, 1),
        tensor_parallel=False,
        sub_block_cuts=True,
        description="DeepSpeed PipelineModule + engine.train_batch() (1F1B, ZeRO <= 1)",
    ),
    "megatron": EngineRules(
        "megatron",
        zero_levels=(0, 1),
        tensor_parallel=True,
        sub_block_cuts=False,
        description="Megatron-LM pretrain_gpt.py (1F1B or interleaved, tensor/sequence parallel, distributed optimizer)",
        recompute_modes=("none", "selective", "full"),
    ),
    "torch": EngineRules(
        "torch",
        zero_levels=(0,),
        tensor_parallel=False,
        sub_block_cuts=True,
        description="torch.distributed.pipelining PipelineStage + schedule classes",
    ),
}

#: schedules the search considers for each engine (looped-bfs, interleaved-zb and dualpipev are
#: priced on request with --schedule but not searched by default: they add little over these)
SEARCHED_SCHEDULES = {
    "deepspeed": ("1f1b",),
    "megatron": ("1f1b", "interleaved"),
    "torch": ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv"),
}


def engine_rules(name: str) -> EngineRules:
    if name not in ENGINES:
        raise UsageError(f"Unknown engine {name!r}.{did_you_mean(name, ENGINES)}", f"Use one of {', '.join(ENGINES)}.")
    return ENGINES[name]


def state_recipe_for(engine: str, precision: str, zero: int, distributed_optimizer: bool = False, optimizer: str = "adam") -> StateRecipe:
    """Model-state bytes per parameter as each engine allocates them (see the module docstring)."""
    if engine == "megatron":
        # bf16/fp16 weights, fp32 main grads, fp32 master + Adam; sharded by the distributed optimizer
        grad = 4.0 if precision in ("bf16", "fp16") else None
        return state_recipe(precision, optimizer, grad_bytes=grad, zero=1 if (distributed_optimizer or zero >= 1) else 0)
    if engine == "deepspeed":
        if precision == "bf16":
            # BF16_Optimizer partitions master and moments over dp at ZeRO 0 and 1; ZeRO 1 is rendered with
            # data_types.grad_accum_dtype = fp32 (4-byte gradients), ZeRO 0 accumulates in bf16 (2 bytes). The bf16
            # gradients themselves are freed after accumulation only because the rendered config sets
            # bf16.immediate_grad_update (measured: 6 bytes per parameter without it, 4 with it).
            return state_recipe(precision, optimizer, grad_bytes=4.0 if zero >= 1 else 2.0, zero=1)
        recipe = state_recipe(precision, optimizer, zero=zero)
        if precision == "fp32" and zero >= 1:
            # ZeRO-1 keeps an fp32 copy of each rank's partition even for fp32 models (stage_1_and_2.py)
            recipe = StateRecipe(recipe.weight_bytes, recipe.grad_bytes, 4.0, recipe.optimizer_bytes, True, recipe.shard_grads, recipe.shard_weights)
        return recipe
    # torch: fp32 master parameters with bf16 autocast compute -> 4 + 4 + 8 (Adam)
    if precision in ("bf16", "fp16"):
        return StateRecipe(4.0, 4.0, 0.0, OPTIMIZER_STATE_BYTES[optimizer])
    return state_recipe(precision, optimizer, zero=zero)


def schedule_rules(engine: str, schedule: str, pp: int, m: int, v: int) -> list[str]:
    """Why (engine, schedule, pp, micro-batches, v) cannot run; empty when it can."""
    problems = schedule_constraints(schedule, pp, m, v, engine)
    if m < pp and schedule != "gpipe":
        problems.append(f"{m} micro-batches cannot fill {pp} pipeline stages: each step would idle most ranks (need at least {pp})")
    return problems


def zero_rules(engine: str, zero: int, pp: int) -> list[str]:
    """Why ZeRO stage ``zero`` cannot run with this engine and pipeline depth."""
    if engine == "deepspeed" and zero >= 2 and pp > 1:
        return [
            f"DeepSpeed refuses ZeRO stage {zero} with pipeline parallelism (PipelineEngine asserts "
            "'ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism' at start-up, after building the optimizer); use stage 0 or 1"
        ]
    if zero not in ENGINES[engine].zero_levels:
        return [f"{engine} runs ZeRO stages {', '.join(map(str, ENGINES[engine].zero_levels))} with a pipeline, not {zero}"]
    return []
