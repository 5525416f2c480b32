"""The loss a model is trained on when its model file defines none.

The mean squared error of every floating-point output against a fixed ramp over its last dimension (-1 to 1), in
fp32: a loss bounded below, of order one, that training lowers, and whose gradient reaches every weight. The plain
mean and the mean square do not: after a final LayerNorm at its initial weight and bias both are constant in the
input (each row has mean 0 and variance 1), so their gradient stops at the last norm's own weights and a smoke run
compares pipelines whose backward carries nothing. A ramp is in the span of neither the constant row nor the row itself.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from planner.errors import UsageError


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
