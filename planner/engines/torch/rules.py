"""The torch engine: the user's own model cut into PipelineStage modules driven by torch.distributed.pipelining's
schedule classes (planner.engines.pipelining), any cut expressible. The rendered script trains fp32 master parameters
under bf16 autocast, with plain data parallelism (no ZeRO).
"""

from __future__ import annotations

from planner.engines.pipelining import PipeliningEngine
from planner.solve.memory import OPTIMIZER_STATE_BYTES, StateRecipe, state_recipe
from planner.solve.plan import Layout
from planner.solve.schedules import SCHEDULE_INFO


class TorchEngine(PipeliningEngine):
    name = "torch"
    title = "torch.distributed.pipelining"
    description = "torch.distributed.pipelining PipelineStage + schedule classes"
    zero_levels: tuple[int, ...] = (0,)

    def state_recipe(self, precision: str, zero: int, optimizer: str = "adam", layout: Layout | None = None) -> StateRecipe:
        # fp32 master parameters with bf16 autocast compute -> 4 + 4 + 8 (Adam)
        if precision in ("bf16", "fp16"):
            return StateRecipe(4.0, 4.0, 0.0, OPTIMIZER_STATE_BYTES[optimizer])
        return state_recipe(precision, optimizer, zero=zero)

    def sends_output_copies(self, schedule: str) -> bool:
        # torch's input-gradient pass detaches a stage's outputs in place, so the rendered stages send copies:
        # one more output cut per micro-batch in flight (planner.engines.torch.runner.StageModule)
        return SCHEDULE_INFO[schedule].split_backward


ENGINE = TorchEngine()
