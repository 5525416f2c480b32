"""The single-process reference run that every rendered training script must reproduce (engine-independent).

One process trains the whole model with the script contract's model, seed,
data and optimizer, accumulating gradients over every micro-batch of every
data-parallel replica: per step ``s`` the global batch is
``PlannedModel.example_batch(global_batch, seed * 100003 + s)``, replica ``d``
takes samples ``[d*B/dp, (d+1)*B/dp)`` split into micro-batches of
``micro_batch`` in order, and each micro-batch's loss is divided by
``num_microbatches * dp`` before its backward. ``torch.optim.AdamW(lr,
weight_decay=0)`` then steps once. The recorded loss of a step is the mean of
the micro-batch losses (the mean over the whole global batch).

The helpers here (data slicing, ``--no-dropout``, precision, loss scaling) are
what the rendered scripts use too, so the two sides cannot drift apart.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from planner.model.trace import call_model
from planner.runners.contract import PRECISIONS  # noqa: F401 (the scripts' --precision choices)
from planner.runtime import PlannedModel

STEP_SEED_STRIDE = 100003  # data seed of step s: seed * STEP_SEED_STRIDE + s
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class BatchLayout:
    """How one step's global batch is cut: samples per step, per micro-batch, micro-batches per replica, replicas."""

    global_batch: int
    micro_batch: int
    num_microbatches: int
    dp: int

    @classmethod
    def from_plan(cls, plan: dict[str, Any]) -> BatchLayout:
        lay = plan["layout"]
        out = cls(int(lay["global_batch"]), int(lay["micro_batch"]), int(lay["num_microbatches"]), int(lay["dp"]))
        if out.micro_batch * out.num_microbatches * out.dp != out.global_batch:
            raise ValueError(
                f"plan.json layout is inconsistent: micro_batch {out.micro_batch} x num_microbatches "
                f"{out.num_microbatches} x dp {out.dp} != global_batch {out.global_batch}"
            )
        return out

    @property
    def per_replica(self) -> int:
        """Samples per data-parallel replica per step."""
        return self.global_batch // self.dp


def step_seed(seed: int, step: int) -> int:
    """The data seed of step ``step`` (the same on every rank)."""
    return seed * STEP_SEED_STRIDE + step


def global_batch(planned: PlannedModel, layout: BatchLayout, seed: int, step: int) -> tuple[tuple[torch.Tensor, ...], Any]:
    """(inputs, target) of the whole global batch of step ``step``: deterministic, identical on every rank."""
    return planned.example_batch(layout.global_batch, seed=step_seed(seed, step))


def _rows(value: Any, start: int, stop: int) -> Any:
    return value[start:stop] if isinstance(value, torch.Tensor) else value


def replica_batch(inputs: Sequence[torch.Tensor], target: Any, layout: BatchLayout, replica: int) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Samples ``[replica*B/dp, (replica+1)*B/dp)`` of a global batch."""
    n = layout.per_replica
    lo, hi = replica * n, (replica + 1) * n
    return tuple(_rows(t, lo, hi) for t in inputs), _rows(target, lo, hi)


def microbatches(inputs: Sequence[torch.Tensor], target: Any, layout: BatchLayout) -> Iterator[tuple[tuple[torch.Tensor, ...], Any]]:
    """A replica's batch cut into ``num_microbatches`` consecutive micro-batches of ``micro_batch`` samples."""
    b = layout.micro_batch
    for i in range(layout.num_microbatches):
        yield tuple(_rows(t, i * b, (i + 1) * b) for t in inputs), _rows(target, i * b, (i + 1) * b)


def build_model(planned: PlannedModel, seed: int, no_dropout: bool = False) -> nn.Module:
    """The real model in fp32 on the CPU, initialised from ``seed``, in training mode.

    ``no_dropout`` passes ``dropout=0`` to ``build_model`` when it takes a
    ``dropout`` argument and sets ``p = 0`` on every dropout module (the
    contract's ``--no-dropout``, needed for exact loss comparisons).
    """
    mf = planned.model_file
    saved = mf.model_args
    if no_dropout and "dropout" in inspect.signature(mf.funcs["build_model"]).parameters:
        mf.model_args = {**saved, "dropout": 0.0}
    try:
        model = planned.build(seed, torch.float32)
    finally:
        mf.model_args = saved
    if no_dropout:
        disable_dropout(model)
    return model.train()


#: attribute names of the probabilities of functional dropout and stochastic depth kept on modules and configs
#: (transformers' BartAttention.dropout, activation_dropout, attention_dropout, hidden_dropout_prob, attn_pdrop; timm's
#: and transformers' DropPath.drop_prob, drop_path_rate; LayerDrop's encoder_layerdrop; torchvision's StochasticDepth.p)
_DROP_NAME = re.compile(r"(dropout|pdrop|drop_prob|drop_path|drop_rate|drop_block|layerdrop)")


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability of ``model`` to 0: ``p`` of the dropout modules (nn.Dropout, Dropout1d/2d/3d,
    AlphaDropout, ...) and of torchvision's StochasticDepth, and every float attribute named for dropout or stochastic
    depth (:data:`_DROP_NAME`) on the modules and on the configs they keep (models that call ``F.dropout(x,
    p=self.dropout)`` or read ``self.config.attention_dropout`` in forward)."""
    for mod in model.modules():
        if isinstance(mod, nn.modules.dropout._DropoutNd) or (type(mod).__name__ == "StochasticDepth" and isinstance(getattr(mod, "p", None), float)):
            mod.p = 0.0  # type: ignore[assignment]
        for owner in (mod, getattr(mod, "config", None)):
            fields = getattr(owner, "__dict__", {})
            for name, value in list(fields.items()):
                if type(value) is float and value > 0 and _DROP_NAME.search(name):
                    setattr(owner, name, 0.0)


def resolve_device(arg: str) -> torch.device:
    """``auto``: CUDA when available, else the CPU."""
    if arg == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if arg not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {arg!r}")
    if arg == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch.cuda.is_available() is False")
    return torch.device(arg)


def resolve_precision(arg: str, plan: dict[str, Any], device: torch.device) -> str:
    """``auto``: the plan's dtype on a GPU, fp32 on the CPU. Returns fp32, bf16 or fp16."""
    if arg not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {arg!r}")
    if arg != "auto":
        return arg
    if device.type != "cuda":
        return "fp32"
    dtype = plan.get("inputs", {}).get("dtype", "bf16")
    return dtype if dtype in AUTOCAST_DTYPES else "fp32"


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Mixed precision for the forward: autocast to bf16/fp16 over fp32 master weights; nothing for fp32."""
    if precision not in AUTOCAST_DTYPES:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])


class LossScaler:
    """Dynamic loss scaling for fp16 (a scale of 1 that never changes for fp32 and bf16).

    The loss is multiplied by ``scale`` before backward and the gradients
    divided by it after; a step whose gradients hold inf/NaN is skipped and the
    scale halved; after ``growth_interval`` clean steps it doubles.
    """

    def __init__(self, precision: str, init_scale: float = 2.0**16, growth_interval: int = 2000):
        self.enabled = precision == "fp16"
        self.scale = float(init_scale) if self.enabled else 1.0
        self.growth_interval = growth_interval
        self._clean_steps = 0

    def update(self, found_inf: bool) -> bool:
        """Record one step's overflow check; returns True when the optimizer should step."""
        if not self.enabled:
            return True
        if found_inf:
            self.scale /= 2.0
            self._clean_steps = 0
            return False
        self._clean_steps += 1
        if self._clean_steps % self.growth_interval == 0:
            self.scale *= 2.0
        return True


def has_inf_or_nan(params: Sequence[nn.Parameter]) -> bool:
    return any(p.grad is not None and not torch.isfinite(p.grad).all() for p in params)


def reference_losses(
    planned: PlannedModel,
    plan_dict: dict[str, Any],
    steps: int,
    seed: int,
    lr: float,
    device: str | torch.device,
    precision: str,
    no_dropout: bool = True,
) -> list[float]:
    """Per-step losses of a single process training the whole model as the contract describes.

    Args:
        planned: the traced model (``load_planned_model(plan_dict, model_path)``).
        plan_dict: plan.json as a dict (its layout gives the batch slicing).
        steps: optimizer steps.
        seed: model-init and data seed (as the scripts' ``--seed``).
        lr: AdamW learning rate.
        device: ``cpu``, ``cuda`` or ``auto``.
        precision: ``fp32``, ``bf16``, ``fp16`` or ``auto`` (autocast over fp32 weights).
        no_dropout: the scripts' ``--no-dropout`` (on by default: the reference exists for exact comparisons).

    Returns:
        The loss of each step, averaged over all micro-batches of all replicas.
    """
    dev = resolve_device(device) if isinstance(device, str) else torch.device(device)
    precision = resolve_precision(precision, plan_dict, dev)
    layout = BatchLayout.from_plan(plan_dict)
    model = build_model(planned, seed, no_dropout).to(dev)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    scaler = LossScaler(precision)
    count = layout.num_microbatches * layout.dp
    out: list[float] = []
    for step in range(steps):
        inputs, target = global_batch(planned, layout, seed, step)
        total = 0.0
        for d in range(layout.dp):
            rep_inputs, rep_target = replica_batch(inputs, target, layout, d)
            for mb_inputs, mb_target in microbatches(rep_inputs, rep_target, layout):
                mb_inputs = tuple(t.to(dev) for t in mb_inputs)
                mb_target = mb_target.to(dev) if isinstance(mb_target, torch.Tensor) else mb_target
                with autocast(precision, dev):
                    output = call_model(model, mb_inputs, planned.model_file.input_names)
                loss = planned.loss(output, mb_target)
                (loss * (scaler.scale / count)).backward()
                total += float(loss.detach())
        if scaler.enabled:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(scaler.scale)
        if scaler.update(has_inf_or_nan(params) if scaler.enabled else False):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(total / count)
        if not math.isfinite(out[-1]):
            raise FloatingPointError(f"reference loss is {out[-1]} at step {step}")
    return out
