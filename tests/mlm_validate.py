"""Megatron-LM's own argument handling on a flag list: ``parse_args``, ``validate_args`` and ``core_transformer_config_from_args``
of megatron/training/arguments.py, from a Megatron-LM checkout at core_v0.16.1 named by ``MEGATRON_LM_PATH``.

megatron-core (installed) does not ship megatron/training, so tests that use this are skipped without a checkout:
``git clone --branch core_v0.16.1 https://github.com/NVIDIA/Megatron-LM && MEGATRON_LM_PATH=$PWD/Megatron-LM pytest``.
Only arguments.py and what it imports are loaded (megatron/training/__init__.py imports the trainer and triton).
This machine has no GPU: the device queries validate_args makes are answered for the given compute capability (an A100's 8.0 by default),
and rope fusion (a Transformer Engine kernel) is turned off after validation except for multi-latent attention,
whose config checks only the rope type.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from unittest import mock

import pytest


def megatron_lm_path() -> Path | None:
    root = os.environ.get("MEGATRON_LM_PATH")
    if not root or not (Path(root) / "megatron" / "training" / "arguments.py").is_file():
        return None
    return Path(root)


def arguments_module():
    """megatron.training.arguments from the checkout (skips the test when there is none)."""
    root = megatron_lm_path()
    if root is None:
        pytest.skip("MEGATRON_LM_PATH does not name a Megatron-LM core_v0.16.1 checkout")
    if "megatron.training.arguments" in sys.modules:
        return sys.modules["megatron.training.arguments"]
    if str(root) not in sys.path:
        sys.path.append(str(root))  # last: megatron.legacy from the checkout, megatron.core stays the installed one
    pkg = types.ModuleType("megatron.training")
    pkg.__path__ = [str(root / "megatron" / "training")]
    sys.modules["megatron.training"] = pkg
    try:
        import six  # noqa: F401  (the BERT tokenizer module arguments.py imports needs it)
    except ImportError:
        sys.modules["six"] = types.ModuleType("six")
    import megatron.training.global_vars as global_vars

    for name in dir(global_vars):
        if name.startswith("get_"):
            setattr(pkg, name, getattr(global_vars, name))
    import megatron.training.arguments as arguments

    return arguments


def megatron_lm_config(argv: list[str], world_size: int, max_connections: str | None = "1", capability: tuple[int, int] = (8, 0)):
    """(args, TransformerConfig) as pretrain_gpt.py would build them from ``argv`` with CUDA_DEVICE_MAX_CONNECTIONS set to
    ``max_connections`` (None: unset) on GPUs of compute ``capability``; raises what Megatron-LM raises."""
    import torch

    A = arguments_module()
    env = {"WORLD_SIZE": str(world_size), "RANK": "0"} | ({"CUDA_DEVICE_MAX_CONNECTIONS": max_connections} if max_connections else {})
    with (
        mock.patch.object(sys, "argv", ["pretrain_gpt.py", *argv]),
        mock.patch.dict(os.environ, env),
        mock.patch.object(torch.cuda, "get_device_capability", lambda *a, **k: capability),
        mock.patch.object(torch.cuda, "get_device_properties", lambda *a, **k: types.SimpleNamespace(major=capability[0], minor=capability[1], name="GPU")),
    ):
        if max_connections is None:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)  # patch.dict restores it on exit
        args = A.parse_args()
        args.world_size, args.rank = world_size, 0
        A.validate_args(args, {})
        if not args.multi_latent_attention:
            args.apply_rope_fusion = False
        return args, A.core_transformer_config_from_args(args)
