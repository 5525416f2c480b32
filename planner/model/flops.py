"""FLOP formulas where torch's FlopCounterMode is wrong or blind, and the ops it cannot see.

* ``aten._grouped_mm`` (the grouped GEMM of MoE experts, transformers'
  default ``grouped_mm`` experts): no formula in torch. The routed tokens are
  the rows actually multiplied, so the count is 2 x rows x K x N: top-k
  experts per token, not all experts.
* ``aten.convolution_backward``: torch's formula transposes the weight's
  channel dims, which for a grouped or depthwise convolution counts the
  gradient of the input ``groups`` times over (a depthwise 7x7 conv's backward
  comes out ~97x its forward). Each requested gradient (input, weight) costs
  exactly the forward's multiply-adds, and the bias gradient nothing.

All counts are FLOPs (2 per multiply-add), as FlopCounterMode counts them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry, shape_wrapper

_aten = torch.ops.aten

# Op names that do arithmetic in proportion to a product of dims: with no formula, they are costed as nothing.
_COMPUTE_WORDS = ("mm", "matmul", "conv", "attention", "linear", "einsum", "baddbmm", "addbmm", "_scaled_")


def _prod(xs: Any) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def grouped_mm_flop(a_shape, b_shape, offs_shape=None, bias_shape=None, out_dtype=None, *, out_shape=None, **kwargs) -> int:
    """FLOPs of ``aten._grouped_mm(a, b, offs)``.

    2-D x 3-D (MoE forward: routed rows x per-expert weights) and 3-D x 2-D:
    2 x out.numel() x K. 2-D x 2-D with ``offs`` (weight gradient: K split into
    groups): 2 x M x N x K_total. 3-D x 3-D (batched): 2 x out.numel() x K.
    """
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * int(out_shape[-2]) * int(out_shape[-1]) * int(a_shape[1])
    return 2 * _prod(out_shape) * int(a_shape[-1])


def conv_forward_flop(x_shape, w_shape, out_shape, transposed: bool) -> int:
    """2 x multiply-adds of a (grouped) convolution: each output (input, if transposed) position x the weight's size."""
    batch = int(x_shape[0])
    spatial = _prod(x_shape[2:]) if transposed else _prod(out_shape[2:])
    return 2 * batch * spatial * _prod(w_shape)


def conv_backward_flop(
    grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed, _output_padding, _groups, output_mask, out_shape=None, **kwargs
) -> int:
    """Backward of a convolution: the forward's FLOPs for the input gradient and again for the weight gradient."""
    fwd = conv_forward_flop(x_shape, w_shape, grad_out_shape, bool(transposed))
    return fwd * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


FORMULAS = {
    _aten._grouped_mm: grouped_mm_flop,
    _aten.convolution_backward: conv_backward_flop,
}

# what the per-operator meters look up: torch's registry with the formulas above (taking tensors, like torch's)
REGISTRY = {**flop_registry, **{k: shape_wrapper(v) for k, v in FORMULAS.items()}}


def flop_counter() -> FlopCounterMode:
    """A FlopCounterMode with the corrected and added formulas."""
    return FlopCounterMode(display=False, custom_mapping=FORMULAS)


def uncounted_compute(func: Any, tensors: list[torch.Tensor], min_numel: int = 4096) -> bool:
    """Whether ``func`` looks like arithmetic on floating tensors (a GEMM, a convolution, attention) but has no formula.

    Such an op would be costed as memory traffic only: the caller notes its name.
    """
    if func.overloadpacket in REGISTRY:
        return False
    name = func.overloadpacket.__name__.lower()
    if not any(w in name for w in _COMPUTE_WORDS):
        return False
    floats = [t for t in tensors if t.is_floating_point() and t.dim() >= 2]
    return len(floats) >= 2 and max(t.numel() for t in floats) >= min_numel
