"""Device policies that refuse the meta device although the operator behind them runs there.

Some PyTorch functions check the device of their inputs before calling an operator, to refuse devices that have no
kernel. On the meta device no kernel runs (only shapes and dtypes are computed), so such a check refuses a model the
planner can trace and cost. ``meta_allowed()`` lets meta tensors through these checks, and only meta tensors: on
every other device the check runs as PyTorch wrote it.

Why not fake tensors that claim a real device: a FakeTensorMode tensor claiming ``cpu`` meets FlexAttention's "no
backward on CPU" refusal (torch 2.13, ``torch/nn/attention/flex_attention.py``, ``_validate_device``), and one
claiming ``cuda`` aborts the process in a CPU build of torch ("PyTorch is not linked with support for cuda devices",
raised from a device guard in C++, not as a Python exception). The operator itself, the higher-order op
``torch.ops.higher_order.flex_attention``, runs forward and backward on meta.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

#: (module, function, what it refuses): checks that refuse meta tensors before an operator that runs on meta
POLICIES: tuple[tuple[str, str, str], ...] = (
    # torch 2.13 torch/nn/attention/flex_attention.py _validate_device: "FlexAttention is only supported on CUDA,
    # CPU, HPU, or MPS devices. Found input tensors on meta device"
    ("torch.nn.attention.flex_attention", "_validate_device", "flex_attention"),
)


#: (module, attribute, value, why): settings that keep an operator's eager path free of torch.compile, which refuses
#: to run under the dispatch modes costing counts with ("non-infra torch dispatch mode present")
SETTINGS: tuple[tuple[str, str, Any, str], ...] = (
    # torch 2.13 flex_attention.py: in eager mode flex_attention compiles a wrapper of its operator
    # (torch.compile(..., fullgraph=True)); with this flag set it calls the operator directly
    ("torch.nn.attention.flex_attention", "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True, "flex_attention"),
    # functions the model compiles itself (torchtitan: torch.compile(flex_attention) as a class attribute) run
    # eagerly: inductor cannot compile for the meta device, and the costs are the eager operators' either way
    ("torch._dynamo.config", "disable", True, "torch.compile"),
)


def _on_meta(args: tuple[Any, ...]) -> bool:
    return any(getattr(a, "device", None) is not None and a.device.type == "meta" for a in args)


def _lets_meta_through(check: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if _on_meta(args):
            return None
        return check(*args, **kwargs)

    wrapped.__wrapped__ = check  # type: ignore[attr-defined]
    return wrapped


@contextlib.contextmanager
def meta_allowed() -> Iterator[None]:
    """Within the block, the checks of POLICIES let meta tensors through and SETTINGS hold (restored on exit)."""
    restore: list[tuple[Any, str, Any]] = []
    try:
        for module_name, name, _ in POLICIES:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            check = getattr(module, name, None)
            if check is None or hasattr(check, "__wrapped__"):
                continue
            restore.append((module, name, check))
            setattr(module, name, _lets_meta_through(check))
        for module_name, name, value, _ in SETTINGS:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            if hasattr(module, name):
                restore.append((module, name, getattr(module, name)))
                setattr(module, name, value)
        yield
    finally:
        for module, name, check in reversed(restore):
            setattr(module, name, check)
