"""load → trace → cost in one call: what `planner inspect` and `planner plan` start from."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from planner.errors import UsageError
from planner.model.cost import cost_layers
from planner.model.load import ModelFile, load_model_file
from planner.model.meta_policies import meta_allowed
from planner.model.sources import transformers_config
from planner.model.trace import LayerGraph, build_layer_graph, idle_modules
from planner.records import ModelCosts

BATCH_STATS_MIN = 2  # the smallest micro-batch a BatchNorm layer trains on (one value per channel is refused)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Analysis:
    model_file: ModelFile
    layer_graph: LayerGraph
    costs: ModelCosts
    #: (transformers config, causal LM?) of a model built from transformers' classes (sources.transformers_config)
    transformers: tuple[Any, bool] | None = None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise UsageError(f"Unknown dtype {name!r}.", f"Use one of {', '.join(DTYPES)}.") from None


def infer_seq_len(arch: dict[str, Any] | None, inputs: tuple[torch.Tensor, ...]) -> int | None:
    """Sequence length from ``architecture()``, else from a (batch, seq) integer input."""
    if arch and arch.get("seq_length"):
        return int(arch["seq_length"])
    first = inputs[0] if inputs else None
    if first is not None and first.dim() == 2 and not first.is_floating_point():
        return int(first.shape[1])
    return None


def analyze(*args: Any, **kwargs: Any) -> Analysis:
    """``_analyze`` (below) with the device checks that refuse meta tensors before operators that run on meta lifted
    (planner.model.meta_policies: flex attention)."""
    with meta_allowed():
        return _analyze(*args, **kwargs)


def _analyze(
    path: str | Path,
    model_args: dict[str, Any] | None = None,
    micro_batch: int = 1,
    dtype: str = "bf16",
    leaf: list[str] | None = None,
    tracer: str = "auto",
    sub_block_cuts: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
) -> Analysis:
    """Load ``path``, build its model on meta, trace it and cost every piece for ``micro_batch`` samples.

    A model with BatchNorm layers is costed at BATCH_STATS_MIN samples at least (the costs record the
    micro-batch they were taken at; the search scales them).
    """
    if micro_batch < 1:
        raise UsageError(f"--micro-batch must be at least 1, got {micro_batch}.")
    if tracer not in ("auto", "fx", "export"):
        raise UsageError(f"Unknown tracer {tracer!r}.", "Use auto, fx or export.")
    tdtype = torch_dtype(dtype)
    mf = load_model_file(path, model_args)
    if progress:
        progress("build", 0, 1)
    model = mf.build_meta(tdtype)
    notes: list[str] = []
    if micro_batch < BATCH_STATS_MIN and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        notes.append(
            f"costed at micro-batch {BATCH_STATS_MIN}, not {micro_batch}: BatchNorm needs more than one sample per "
            "channel to train; per-sample costs are the same"
        )
        micro_batch = BATCH_STATS_MIN
    arch = mf.architecture()
    inputs = mf.inputs_meta(micro_batch, tdtype)
    inputs2 = mf.inputs_meta(2 * micro_batch, tdtype)
    empty = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.numel() == 0]
    step = "tracing"
    try:
        if progress:
            progress("trace", 0, 1)
        lg = build_layer_graph(model, inputs, inputs2, leaf_classes=leaf or (), tracer=tracer, sub_block_cuts=sub_block_cuts, input_names=mf.input_names)
        idle = idle_modules(model, lg.gm)
        if idle:
            listed = ", ".join(f"{path} ({n:,})" for path, n in idle[:4]) + (f" and {len(idle) - 4} more" if len(idle) > 4 else "")
            notes.append(
                f"{sum(n for _, n in idle):,} parameters are in no piece: forward() does not read {listed} on these "
                "inputs, so they are not planned (in no stage's memory or parameter count) and the scripts do not train them"
            )
        lg.notes = list(mf.notes) + notes + lg.notes
        seq = infer_seq_len(arch, inputs)
        step = "costing"
        costs = cost_layers(
            lg,
            inputs,
            micro_batch,
            tdtype,
            seq_len=seq,
            model_file=mf,
            architecture=arch,
            progress=(lambda i, n: progress("cost", i, n)) if progress else None,
        )
    except Exception as e:
        if not empty or isinstance(e, (UsageError, MemoryError)) or os.environ.get("PLANNER_DEBUG"):
            raise
        name, shape = empty[0]
        raise UsageError(
            f"{mf.name}: {step} failed ({type(e).__name__}: {' '.join(str(e).split())[:300]}), and the model built has "
            f"{len(empty)} parameter(s) with no elements, e.g. {name!r} of shape {list(shape)}.",
            "A size the model's config or --model-arg sets is 0 (a vocabulary, width or head count); set it to at least 1.",
        ) from e
    return Analysis(mf, lg, costs, transformers_config(model))
