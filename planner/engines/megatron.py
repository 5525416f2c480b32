"""Megatron-LM (pretrain_gpt.py building its own GPT model from flags).

Facts (Megatron-LM core_v0.16.1; README "Engine rules"): stages can only be cut
between whole transformer layers, with the final norm, output layer and loss on
the last stage; it runs 1F1B or interleaved 1F1B (virtual stages), tensor and
sequence parallelism, the distributed optimizer (6 + 12/d bytes per parameter)
and fp32 main gradients (18 bytes per parameter without it). Interleaving needs
the number of micro-batches to be a multiple of pp and at least pp (point-to-point
overlap is on by default, so pp = 2 interleaves too). ``--overlap-grad-reduce``
reduces gradient buckets during the backward.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from planner.engines.base import Engine
from planner.megatron_args import architecture_problem, tensor_parallel_problems
from planner.records import ModelCosts
from planner.solve.memory import StateRecipe, state_recipe


class MegatronEngine(Engine):
    name = "megatron"
    description = "Megatron-LM pretrain_gpt.py (1F1B or interleaved, tensor/sequence parallel, distributed optimizer)"
    schedules = ("1f1b", "interleaved")
    searched_schedules = ("1f1b", "interleaved")
    zero_levels = (0, 1)
    tensor_parallel = True
    sub_block_cuts = False
    recompute_modes = ("none", "selective", "full")

    def state_recipe(self, precision: str, zero: int, optimizer: str = "adam") -> StateRecipe:
        # bf16/fp16 weights, fp32 main grads, fp32 master + Adam; zero >= 1 is the distributed optimizer
        grad = 4.0 if precision in ("bf16", "fp16") else None
        return state_recipe(precision, optimizer, grad_bytes=grad, zero=1 if zero >= 1 else 0)

    def exposed_dp_time(self, comm_s: float, backward_s: Sequence[float]) -> float:
        # --overlap-grad-reduce: buckets reduce during the last micro-batch's backward
        return max(0.0, comm_s - sum(backward_s))

    def allowed_cuts(self, costs: ModelCosts) -> np.ndarray:
        """Only between whole transformer layers; the embedding stays with the first layer, the final norm,
        output layer and loss with the last, so the first and last stages always hold a layer."""
        n = costs.n
        allowed = np.ones(n + 1, dtype=bool)
        blocks = [i for i, layer in enumerate(costs.layers) if layer.block is not None]
        if not blocks:
            return allowed
        first, last = blocks[0], blocks[-1]
        for k in range(1, n):
            prev, cur = costs.layers[k - 1], costs.layers[k]
            whole = cur.block is None or cur.block != prev.block
            allowed[k] = whole and first < k <= last
        return allowed

    def runtime_schedule_problems(self, schedule: str, pp: int, m: int, v: int) -> list[str]:
        out = super().runtime_schedule_problems(schedule, pp, m, v)
        if schedule == "interleaved":
            if m % pp != 0:
                out.append(f"Megatron interleaved 1F1B needs m to be a multiple of p ({pp}), got m={m}")
            if m < pp:
                out.append(f"Megatron interleaved 1F1B needs m >= p ({pp}), got m={m}")
        return out

    def tensor_parallel_problems(self, costs: ModelCosts, tp: int) -> list[str]:
        if tp == 1:
            return []
        arch = costs.architecture or {}
        if not arch:
            return ["tensor parallelism needs the model file's architecture() (heads, query groups)"]
        return tensor_parallel_problems(arch, tp)

    def architecture_problem(self, arch: dict[str, Any] | None, model: str) -> tuple[str, str] | None:
        return architecture_problem(arch, model)


ENGINE = MegatronEngine()
