"""What the rendered training scripts import: the planned stages of the user's model, on real weights.

The scripts rebuild the model from the user's file, re-trace it on the meta
device with the options recorded in plan.json, check that the pieces are the
ones the plan was made for (same names, same count: a changed model file
fails loudly instead of training a different split), and wrap the planned
piece ranges of the real model as stage modules. Parameters keep their model
paths inside each stage (``h.3.attn.c_attn.weight``).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from planner.model.analyze import torch_dtype
from planner.model.load import ModelFile, load_model_file
from planner.model.trace import LayerGraph, build_layer_graph


class PlanMismatch(RuntimeError):
    """The model traced at run time does not have the pieces the plan was made for."""


@dataclass
class PlannedModel:
    """The user's model, traced as at planning time, with the plan's stage boundaries."""

    model_file: ModelFile
    layer_graph: LayerGraph
    bounds: list[int]  # piece index where each stage starts, then the piece count
    piece_names: list[str]

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def build(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The real model, initialised from ``seed`` (the same weights on every rank)."""
        seed_everything(seed)
        model = self.model_file.call("build_model")
        return model.to(dtype=dtype)

    def stage(self, model: nn.Module, stage: int) -> nn.Module:
        """The module running planned stage ``stage`` of ``model`` (parameters shared with ``model``)."""
        return self.layer_graph.stage_module(self.bounds[stage], self.bounds[stage + 1], root=model)

    def piece(self, model: nn.Module, index: int) -> nn.Module:
        """One piece as a module: DeepSpeed's PipelineModule takes the pieces as its layer list."""
        return self.layer_graph.stage_module(index, index + 1, root=model)

    def stage_of_piece(self, index: int) -> int:
        return max(s for s in range(self.num_stages) if self.bounds[s] <= index)

    def tied_parameters(self, model: nn.Module) -> list[tuple[str, list[int]]]:
        """Parameters used by more than one stage, with those stages: their gradients must be summed across them."""
        users: dict[int, tuple[str, set[int]]] = {}
        for s in range(self.num_stages):
            mod = self.stage(model, s)
            for name, p in mod.gm.named_parameters(remove_duplicate=True):
                users.setdefault(id(p), (name, set()))[1].add(s)
        return sorted((name, sorted(st)) for name, st in users.values() if len(st) > 1)

    def example_batch(self, batch_size: int, seed: int) -> tuple[tuple[torch.Tensor, ...], Any]:
        """Deterministic (inputs, target) of ``batch_size`` samples from the model file's example functions."""
        seed_everything(seed)
        inputs = self.model_file.call("example_inputs", batch_size)
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        target = self.model_file.call("example_target", batch_size) if self.model_file.has("example_target") else None
        return tuple(inputs), target

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        """The model file's loss_fn, or the mean of the output when it has none."""
        if self.model_file.has("loss_fn") and target is not None:
            return self.model_file.funcs["loss_fn"](output, target)
        flat = [t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return sum(t.float().mean() for t in flat)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def load_planned_model(plan: dict[str, Any] | str | Path, model_path: str | Path | None = None) -> PlannedModel:
    """Trace the user's model as recorded in ``plan`` (a plan.json dict or path) and check its pieces."""
    if not isinstance(plan, dict):
        p = Path(plan)
        plan = json.loads((p / "plan.json" if p.is_dir() else p).read_text())
    inputs = plan["inputs"]
    path = Path(model_path or inputs["model_file"])
    mf = load_model_file(path, inputs.get("model_args", {}))
    dtype = torch_dtype(inputs.get("dtype", "bf16"))
    meta = mf.build_meta(dtype)
    tracer = inputs.get("tracer_used", inputs.get("tracer", "auto"))
    # two samples: BatchNorm over (N, C) refuses a batch of one in training mode; torch.export graphs are
    # static, so they are traced at the micro-batch the scripts run
    batch = plan["layout"]["micro_batch"] if tracer == "export" else 2
    lg = build_layer_graph(
        meta,
        mf.inputs_meta(batch, dtype),
        None,
        leaf_classes=inputs.get("leaf", []),
        tracer=tracer,
        sub_block_cuts=inputs.get("sub_block_cuts", True),
    )
    names = [p.name for p in lg.pieces]
    expected = plan["model"]["pieces"]
    if names != expected:
        diff = next((i for i, (a, b) in enumerate(zip(names, expected)) if a != b), min(len(names), len(expected)))
        raise PlanMismatch(
            f"{path.name} now traces into {len(names)} pieces, the plan was made for {len(expected)}; "
            f"first difference at piece {diff}: {names[diff] if diff < len(names) else '(none)'} vs "
            f"{expected[diff] if diff < len(expected) else '(none)'}. Re-run `planner plan` for this model."
        )
    bounds = [s["pieces"][0] for s in plan["stages"]] + [plan["stages"][-1]["pieces"][1]]
    return PlannedModel(mf, lg, bounds, names)
