"""Build a model without allocating its weights: on the meta device, or with only its parameters and buffers there.

``torch.device("meta")`` puts every tensor a constructor creates on the meta device. Some constructors compute with
tensors and read the result back (torchvision's RegNet derives its block widths with ``torch.round(...).tolist()``),
which the meta device cannot do; for those the build is retried with ordinary tensors and each parameter and buffer
moved to the meta device as the module registers it (before any initializer runs on it), so weights still cost no
memory and no initialization time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import nn

T = TypeVar("T")

#: what torch says when code reads the data of a meta tensor
_META_READS = ("meta tensor", "on meta tensors", "meta device")


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within: every parameter and buffer a module registers is moved to the meta device; other tensors are ordinary."""
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def on_meta_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register_parameter(module, name, param)

    def on_meta_buffer(module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        register_buffer(module, name, None if tensor is None else tensor.to("meta"), persistent)

    nn.Module.register_parameter = on_meta_parameter  # type: ignore[method-assign,assignment]
    nn.Module.register_buffer = on_meta_buffer  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]


def reads_meta_data(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is torch refusing to read a meta tensor's data."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (NotImplementedError, RuntimeError)) and any(w in str(seen) for w in _META_READS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def build_on_meta(build: Callable[[], T]) -> T:
    """``build()`` on the meta device; if its constructor reads tensor data, again with only weights on meta."""
    try:
        with torch.device("meta"):
            return build()
    except Exception as e:
        if not reads_meta_data(e):
            raise
    with parameters_on_meta():
        return build()
