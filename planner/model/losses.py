"""Which loss a model is trained on, and the default for a model that has none.

The choice (``choose_loss``), in order: the model file's ``loss_fn(output, target)`` (target from ``example_target``,
or None where the model takes its targets as inputs, as nanoGPT's ``forward(idx, targets)`` does); else the loss the
model's output carries (a ``loss`` field of a transformers ModelOutput or a dict, or the one scalar of a
``(logits, loss)`` tuple); else, for a model file that gives no targets either, the default below, said in the plan,
the rendered README and the smoke. A file that gives targets (``example_target``) but no ``loss_fn`` and no loss in
its output is refused: the planner would not know what to train the targets on.

The default: the mean squared error of every floating-point output against a fixed ramp over its last dimension (-1 to 1), in
fp32: a loss bounded below, of order one, that training lowers, and whose gradient reaches every weight. The plain
mean and the mean square do not: after a final LayerNorm at its initial weight and bias both are constant in the
input (each row has mean 0 and variance 1), so their gradient stops at the last norm's own weights and a smoke run
compares pipelines whose backward carries nothing. A ramp is in the span of neither the constant row nor the row itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from planner.errors import UsageError
from planner.records import TrainedLoss


def tensor_leaves(x: Any) -> list[torch.Tensor]:
    """The tensors in ``x`` (any nesting of tuples, lists and dicts), in pytree order."""
    return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def floating_outputs(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a model's output (any nesting of tuples, lists and dicts)."""
    return [t for t in tensor_leaves(output) if t.is_floating_point()]


def ramp_target(t: torch.Tensor) -> torch.Tensor:
    """The default loss's target for ``t``: -1 to 1 in equal steps over the last dimension (fp32, broadcast over the rest)."""
    return torch.linspace(-1.0, 1.0, t.shape[-1] if t.dim() else 1, device=t.device)


def default_loss(output: Any) -> torch.Tensor:
    """Sum over the output's floating-point tensors of their mean squared error against ramp_target (fp32)."""
    flat = floating_outputs(output)
    if not flat:
        kinds = sorted({type(t).__name__ if not isinstance(t, torch.Tensor) else f"{t.dtype} tensor" for t in torch.utils._pytree.tree_leaves(output)})
        raise UsageError(
            f"the model's output holds no floating-point tensor to train on ({', '.join(kinds) or 'nothing'}): "
            "define loss_fn(output, target) and example_target(batch_size) in the model file."
        )
    return cast(torch.Tensor, sum((t.float() - ramp_target(t)).square().mean() for t in flat))


def output_loss(output: Any) -> tuple[str, torch.Tensor] | None:
    """(where, tensor) of the loss a model's output carries, else None: the ``loss`` field of a ModelOutput, an
    object or a mapping (a tensor, not None), or of a tuple or list the one element that is a floating-point scalar
    (nanoGPT's ``(logits, loss)``). Two scalars in a tuple are ambiguous: None."""
    field = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(field, torch.Tensor) and field.is_floating_point() and field.dim() == 0:
        return "loss", field
    if isinstance(output, (tuple, list)) and not hasattr(output, "_fields"):
        scalars = [(i, t) for i, t in enumerate(output) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 0]
        if len(scalars) == 1:
            return f"[{scalars[0][0]}]", scalars[0][1]
    return None


def choose_loss(model_file: Any, output: Any) -> TrainedLoss:
    """The loss trained for ``model_file`` (a ModelFile: ``has``, ``name``) whose model returned ``output``.

    Raises UsageError where the file gives targets but nothing to train them on."""
    if model_file.has("loss_fn"):
        if getattr(model_file, "module", True) is None:  # a library spec (hf:, timm:, torchvision:): the planner wrote it
            doc = (model_file.funcs["loss_fn"].__doc__ or "its loss").strip().split(";")[0].split(". ")[0].replace("\n", " ").rstrip(".")
            prefix = str(model_file.name).partition(":")[0]
            return TrainedLoss("loss_fn", f"the loss the planner gives {prefix}: models: {doc[0].lower() + doc[1:]}")
        if model_file.has("example_target"):
            return TrainedLoss("loss_fn", "the model file's loss_fn(output, target), target from example_target()")
        return TrainedLoss("loss_fn", "the model file's loss_fn(output, None): the model takes its targets as inputs")
    carried = output_loss(output)
    if carried is not None:
        where = carried[0]
        shown = f"output.{where}" if where == "loss" else f"output{where}"
        return TrainedLoss("model output", f"the loss the model returns ({shown}); the file defines no loss_fn", where)
    if model_file.has("example_target"):
        raise UsageError(
            f"{model_file.name} defines example_target() but no loss_fn(), and the model's output carries no loss: "
            "nothing says what the targets are trained on.",
            "Define loss_fn(output, target) -> scalar tensor in the model file (for a classifier: "
            "torch.nn.functional.cross_entropy(output, target)), or return the loss from forward().",
        )
    return TrainedLoss(
        "default",
        "the planner's default loss (mean squared error of every floating-point output against a ramp): the model file "
        "defines no loss_fn and the model returns no loss; define loss_fn(output, target) to train your own",
    )


def loss_function(model_file: Any, choice: TrainedLoss, target: Any) -> Callable[[Any], torch.Tensor]:
    """The scalar loss of a model output under ``choice``: ``loss_fn(output, target)``, the output's own loss, or the
    default loss."""
    if choice.source == "loss_fn":
        fn = model_file.funcs["loss_fn"]
        return lambda output: cast(torch.Tensor, fn(output, target))
    if choice.source == "model output":
        return lambda output: _carried(output, choice.where)
    return default_loss


def _carried(output: Any, where: str) -> torch.Tensor:
    carried = output_loss(output)
    if carried is None or carried[0] != where:
        raise UsageError(
            f"the model's output no longer carries its loss at {where!r} (it did when the model was planned).",
            "Return the loss from forward() on every call, or define loss_fn(output, target) in the model file.",
        )
    return carried[1]
