"""Whether a model's loss couples the samples of a batch, so that micro-batching changes what is trained.

A pipeline (and gradient accumulation) computes the loss of each micro-batch on its own and averages them. That is
the loss of the whole batch only when the loss is a mean over samples that never meet. Three checks, all at plan
time and all cheap:

* **samples meet in the model** (``meeting_in_shapes`` on the traced graph at micro-batch b and 2b): a value with two
  dimensions that grow with the batch, the (b, b) similarity of a contrastive loss (open_clip's ``ClipLoss``,
  transformers' ``CLIPModel(return_loss=True)``) or an in-batch-negatives retrieval loss;
* **samples meet in loss_fn** (``meeting_in_loss``): the same test on the shapes of every operator ``loss_fn`` runs,
  on the meta device, at b and 2b;
* **the loss is not a mean over samples** (``loss_split_gap``): ``loss_fn`` on small random outputs of 2b samples
  against the mean of its two halves; a loss summed over samples (``reduction="sum"``) is twice the halves' mean,
  so its scale (and the gradient's) grows with the micro-batch.

BatchNorm is the fourth way samples meet (its statistics are over the micro-batch); ``batchnorm_layers`` names them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

Shape = tuple[int, ...]

#: the largest output (elements, all tensors at 2b samples) loss_split_gap materialises on the CPU
SPLIT_CHECK_MAX_ELEMENTS = 1 << 20
#: relative gap between the loss of 2b samples and the mean of its halves' losses above which they differ
SPLIT_GAP_TOL = 1e-4


def growing_dims(at_b: Shape, at_2b: Shape) -> tuple[int, ...]:
    """The dimensions of a value that change between micro-batch b and 2b (the batch dimensions)."""
    if len(at_b) != len(at_2b):
        return ()
    return tuple(i for i, (x, y) in enumerate(zip(at_b, at_2b)) if x != y)


def meeting_in_shapes(values: Sequence[tuple[str, Sequence[Shape], Sequence[Shape]]]) -> str | None:
    """The first of ``values`` (name, its tensors' shapes at b, at 2b) with a tensor whose two or more dimensions grow
    with the batch, described in words; None where every value has at most one."""
    for name, at_b, at_2b in values:
        if len(at_b) != len(at_2b):
            continue
        for s1, s2 in zip(at_b, at_2b):
            if len(growing_dims(s1, s2)) >= 2:
                b = _batch_of(s1, s2)
                return f"{name} is {_shape(s1)} at micro-batch {b} and {_shape(s2)} at {2 * b}: indexed by sample twice"
    return None


def _shape(s: Shape) -> str:
    return "x".join(map(str, s)) or "a scalar"


def _batch_of(s1: Shape, s2: Shape) -> int:
    return next(x for x, y in zip(s1, s2) if x != y)


class _Shapes(TorchDispatchMode):
    """Records each operator's name and the shapes of the tensors it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[Shape]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves(out)
        self.ops.append((str(func.overloadpacket.__name__), [tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor)]))
        return out


def _op_shapes(fn: Callable[[], Any]) -> list[tuple[str, list[Shape]]] | None:
    try:
        with torch.no_grad(), _Shapes() as rec:  # no autograd bookkeeping: both runs record the same operators
            fn()
    except Exception:
        return None
    return rec.ops


def meeting_in_loss(loss_at_b: Callable[[], Any], loss_at_2b: Callable[[], Any]) -> str | None:
    """Where samples meet in a loss run (on the meta device) at micro-batch b and 2b: the first operator whose result
    has two dimensions that grow with the batch; None where none does, or the two runs differ in their operators."""
    ops_b, ops_2b = _op_shapes(loss_at_b), _op_shapes(loss_at_2b)
    if ops_b is None or ops_2b is None or [n for n, _ in ops_b] != [n for n, _ in ops_2b]:
        return None
    return meeting_in_shapes([(f"loss_fn's {name}", s1, s2) for (name, s1), (_, s2) in zip(ops_b, ops_2b)])


def _halves(value: Any, template_b: Any) -> tuple[Any, Any] | None:
    """``value`` (2b samples) cut into its two halves of b along each tensor's batch dimension (the one that differs
    from ``template_b``'s); tensors without one go whole into both. None where the structures differ."""
    flat, spec = torch.utils._pytree.tree_flatten(value)
    flat_b, spec_b = torch.utils._pytree.tree_flatten(template_b)
    if spec != spec_b:
        return None
    first, second = [], []
    for t, t_b in zip(flat, flat_b):
        if isinstance(t, torch.Tensor) and isinstance(t_b, torch.Tensor):
            dims = growing_dims(tuple(t_b.shape), tuple(t.shape))
            if len(dims) > 1 or (dims and t.shape[dims[0]] != 2 * t_b.shape[dims[0]]):
                return None
            if dims:
                a, b = t.split(t_b.shape[dims[0]], dim=dims[0])
                first.append(a)
                second.append(b)
                continue
        first.append(t)
        second.append(t)
    return torch.utils._pytree.tree_unflatten(first, spec), torch.utils._pytree.tree_unflatten(second, spec)


def _real(meta: Any, generator: torch.Generator) -> Any:
    """Random CPU values of the meta tensors' shapes and dtypes: normal floats, integers 0 to 1 (valid class indices)."""

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.is_floating_point():
            return torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.dtype)
        if t.dtype == torch.bool:
            return torch.ones(t.shape, dtype=torch.bool)
        return torch.randint(0, 2, t.shape, generator=generator, dtype=t.dtype)

    return torch.utils._pytree.tree_map(one, meta)


def loss_split_gap(loss_fn: Callable[[Any, Any], Any], output_b: Any, output_2b: Any, target_b: Any, target_2b: Any) -> tuple[float, float, float] | None:
    """(loss of 2b samples, loss of the first b, loss of the second b) of ``loss_fn`` on random CPU values of the
    meta outputs' and targets' shapes; None where the outputs are larger than SPLIT_CHECK_MAX_ELEMENTS, cannot be
    cut in halves, or loss_fn fails on random values."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(output_2b) if isinstance(t, torch.Tensor)]
    if sum(t.numel() for t in leaves) > SPLIT_CHECK_MAX_ELEMENTS:
        return None
    g = torch.Generator().manual_seed(0)
    out, tgt = _real(output_2b, g), _real(target_2b, g)
    out_halves, tgt_halves = _halves(out, output_b), _halves(tgt, target_b)
    if out_halves is None or tgt_halves is None:
        return None
    try:
        with torch.no_grad():
            values = [loss_fn(o, t) for o, t in ((out, tgt), (out_halves[0], tgt_halves[0]), (out_halves[1], tgt_halves[1]))]
    except Exception:
        return None
    if not all(isinstance(v, torch.Tensor) and v.numel() == 1 for v in values):
        return None
    whole, a, b = (float(v) for v in values)
    return whole, a, b


def split_gap_words(whole: float, a: float, b: float) -> str | None:
    """What the gap between a loss of 2b samples and its halves' losses says, in words; None where it is their mean."""
    mean = (a + b) / 2
    scale = max(abs(whole), abs(mean), 1e-12)
    if abs(whole - mean) <= SPLIT_GAP_TOL * scale:
        return None
    if abs(whole - (a + b)) <= SPLIT_GAP_TOL * max(abs(whole), 1e-12):
        return "loss_fn sums over samples (the loss of 2b samples is the sum of its halves', not their mean): its scale and the gradient's grow with the micro-batch"
    return f"loss_fn over 2b samples ({whole:.6g}) is not the mean of its halves' ({a:.6g}, {b:.6g})"


def batchnorm_layers(model: nn.Module) -> list[str]:
    """The BatchNorm layers of ``model`` (their statistics are over each micro-batch)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
