"""torch.distributed.pipelining: PipelineStage modules driven by torch's schedule classes.

Facts (torch 2.13): it runs GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
ZBVZeroBubble and DualPipeV over PipelineStage modules, so any cut is expressible.
``Schedule1F1B`` needs micro-batches >= stages; the interleaved and zero-bubble
schedules need the micro-batch count to be a multiple of their rounds
``max(1, m // pp)``; ZBV exactly 2 stages per rank. The rendered script trains
fp32 master parameters under bf16 autocast.
"""

from __future__ import annotations

from planner.engines.base import Engine
from planner.solve.memory import OPTIMIZER_STATE_BYTES, StateRecipe, state_recipe
from planner.solve.plan import Layout
from planner.solve.schedules import SCHEDULE_INFO


class TorchEngine(Engine):
    name = "torch"
    description = "torch.distributed.pipelining PipelineStage + schedule classes"
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h1", "interleaved-zb", "zbv", "dualpipev")
    #: looped-bfs, interleaved-zb and dualpipev are priced on request with --schedule but not searched by default
    searched_schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
    zero_levels: tuple[int, ...] = (0,)

    def state_recipe(self, precision: str, zero: int, optimizer: str = "adam", layout: Layout | None = None) -> StateRecipe:
        # fp32 master parameters with bf16 autocast compute -> 4 + 4 + 8 (Adam)
        if precision in ("bf16", "fp16"):
            return StateRecipe(4.0, 4.0, 0.0, OPTIMIZER_STATE_BYTES[optimizer])
        return state_recipe(precision, optimizer, zero=zero)

    def sends_output_copies(self, schedule: str) -> bool:
        # torch's input-gradient pass detaches a stage's outputs in place, so the rendered stages send copies:
        # one more output cut per micro-batch in flight (planner.runners.torchpp.StageModule)
        return SCHEDULE_INFO[schedule].split_backward

    def runtime_schedule_problems(self, schedule: str, pp: int, m: int, v: int, group: int = 0) -> list[str]:
        out = super().runtime_schedule_problems(schedule, pp, m, v, group)
        rounds = max(1, m // pp)
        if schedule == "1f1b" and m < pp:
            out.append(f"torch Schedule1F1B needs m >= number of stages (m >= p = {pp}), got m={m}")
        if schedule == "zb-h1" and m % rounds != 0:
            out.append(f"torch ScheduleInterleavedZeroBubble needs m to be a multiple of its number of rounds max(1, m // p) = {rounds} (got m={m}, p={pp})")
        return out


ENGINE = TorchEngine()
