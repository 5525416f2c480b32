"""DeepSpeed's own verdicts for `planner validate`: its config class, batch arithmetic and partition methods.

Where ``deepspeed`` is importable, every answer here comes from DeepSpeed itself:
``deepspeed.runtime.config.DeepSpeedConfig`` (run offline, with ``dist.get_rank`` / ``dist.get_world_size``
patched to the data-parallel size, as /work/shared/reference/engines.md describes) and
``deepspeed.runtime.utils.partition_uniform`` / ``partition_balanced``. Where it is not, the functions below marked
*vendored* reproduce DeepSpeed 0.19.8's statements (upstream path given on each), and :func:`type_problems`
gives type and range checks for what DeepSpeedConfig would refuse. ``PLANNER_NO_DEEPSPEED=1`` forces the
fallbacks (for tests and for comparing them with DeepSpeed).

DeepSpeed logs to stdout; its "DeepSpeed" logger is disabled while it is imported and run here, so that
`validate --format json` stays valid JSON.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

#: the DeepSpeed release the vendored fallbacks and the shipped key table follow
VENDORED_VERSION = "0.19.8"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class BatchError(ValueError):
    """DeepSpeedConfig refuses these batch values (the message is DeepSpeed's, or the vendored equivalent)."""


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    log = logging.getLogger("DeepSpeed")
    before = log.disabled
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = before


@lru_cache(maxsize=1)
def _modules() -> tuple[Any, Any] | None:
    """(deepspeed.runtime.config, deepspeed.runtime.utils), or None when deepspeed is not importable."""
    if os.environ.get("PLANNER_NO_DEEPSPEED"):
        return None
    try:
        with _quiet():
            from deepspeed.runtime import (
                config,  # optional heavy dependency (imports torch)
                utils,
            )
    except Exception:  # noqa: BLE001 - any failure to import means: use the fallbacks
        return None
    return config, utils


def available() -> bool:
    """Whether DeepSpeed's own code answers (else the vendored fallbacks do)."""
    return _modules() is not None


def version() -> str:
    """The DeepSpeed whose verdicts these are: the installed one, or the release the fallbacks follow."""
    if available():
        import deepspeed

        return str(deepspeed.__version__)
    return VENDORED_VERSION


@contextlib.contextmanager
def _world(config: Any, data_parallel: int) -> Iterator[None]:
    """Make DeepSpeedConfig see ``data_parallel`` ranks (it reads dist.get_world_size; offline it would assume 1)."""
    dist = config.dist
    saved = dist.get_rank, dist.get_world_size
    dist.get_rank = lambda *a, **k: 0
    dist.get_world_size = lambda *a, **k: data_parallel
    try:
        with _quiet():
            yield
    finally:
        dist.get_rank, dist.get_world_size = saved


def refusal(cfg: dict[str, Any], data_parallel: int = 1) -> Exception | None:
    """The exception DeepSpeedConfig raises for ``cfg`` on ``data_parallel`` ranks, or None when it accepts it.

    Needs deepspeed (see :func:`available`); ``cfg`` is not modified.
    """
    mods = _modules()
    if mods is None:
        raise RuntimeError("deepspeed is not importable")
    config = mods[0]
    with _world(config, data_parallel):
        try:
            config.DeepSpeedConfig(copy.deepcopy(cfg))
        except Exception as e:  # noqa: BLE001 - whatever DeepSpeed raises is its verdict
            return e
    return None


def describe(error: Exception) -> str:
    """DeepSpeed's exception as one line: ``Type: message`` (pydantic's errors as ``Model: field: message``)."""
    parts = field_errors(error)
    if parts:
        title = getattr(error, "title", type(error).__name__)
        return f"{title}: " + "; ".join(text for _, text in parts)
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def field_errors(error: Exception) -> list[tuple[tuple[Any, ...], str]]:
    """(field path inside the model that raised, ``field: message (got value)``) for each error of a pydantic
    ValidationError; [] for other exceptions."""
    errors = getattr(error, "errors", None)
    if not callable(errors):
        return []
    try:
        out = []
        for e in errors():
            loc = tuple(e.get("loc", ()))
            out.append((loc, f"{'.'.join(map(str, loc))}: {e.get('msg')} (got {e.get('input')!r})"))
        return out
    except Exception:  # noqa: BLE001 - not pydantic's interface after all
        return []


# --------------------------------------------------------------------------- batch arithmetic


def batch_values(train_batch: Any, micro_batch: Any, grad_acc: Any, data_parallel: int) -> tuple[Any, Any, Any]:
    """(train_batch_size, micro, gas) as DeepSpeedConfig fills and checks them for ``data_parallel`` ranks.

    DeepSpeedConfig on the three values when deepspeed is importable, else :func:`vendored_batch`.
    Raises :class:`BatchError` where DeepSpeed raises, with its message.
    """
    mods = _modules()
    if mods is None:
        return vendored_batch(train_batch, micro_batch, grad_acc, data_parallel)
    cfg = {k: v for k, v in zip(BATCH_KEYS, (train_batch, micro_batch, grad_acc)) if v is not None}
    config = mods[0]
    with _world(config, data_parallel):
        try:
            ds = config.DeepSpeedConfig(cfg)
        except ZeroDivisionError:
            raise BatchError("a batch value of 0 makes DeepSpeed divide by zero while filling the missing values") from None
        except Exception as e:  # noqa: BLE001 - DeepSpeed's refusal
            raise BatchError(" ".join(str(e).split()) or type(e).__name__) from None
    return ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps


def vendored_batch(train_batch: Any, micro_batch: Any, grad_acc: Any, world_size: int) -> tuple[Any, Any, Any]:
    """Vendored from DeepSpeed 0.19.8 deepspeed/runtime/config.py (``_set_batch_related_parameters`` and
    ``_batch_assertion``): the same statements in the same order; raises :class:`BatchError` where DeepSpeed raises."""
    try:
        if train_batch is not None and micro_batch is not None and grad_acc is not None:
            pass
        elif train_batch is not None and micro_batch is not None:
            grad_acc = train_batch // micro_batch
            grad_acc //= world_size
        elif train_batch is not None and grad_acc is not None:
            micro_batch = train_batch // world_size
            micro_batch //= grad_acc
        elif micro_batch is not None and grad_acc is not None:
            train_batch = micro_batch * grad_acc
            train_batch *= world_size
        elif train_batch is not None:
            grad_acc = 1
            micro_batch = train_batch // world_size
        elif micro_batch is not None:
            train_batch = micro_batch * world_size
            grad_acc = 1
        else:
            raise BatchError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")
        if not train_batch > 0:
            raise BatchError(f"Train batch size: {train_batch} has to be greater than 0")
        if not micro_batch > 0:
            raise BatchError(f"Micro batch size per gpu: {micro_batch} has to be greater than 0")
        if not grad_acc > 0:
            raise BatchError(f"Gradient accumulation steps: {grad_acc} has to be greater than 0")
        if train_batch != micro_batch * grad_acc * world_size:
            raise BatchError(
                f"Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size "
                f"{train_batch} != {micro_batch} * {grad_acc} * {world_size}"
            )
    except ZeroDivisionError:
        raise BatchError("a batch value of 0 makes DeepSpeed divide by zero while filling the missing values") from None
    except TypeError:
        raise BatchError(
            f"batch values must be numbers (train_batch_size={train_batch!r}, train_micro_batch_size_per_gpu={micro_batch!r}, "
            f"gradient_accumulation_steps={grad_acc!r})"
        ) from None
    return train_batch, micro_batch, grad_acc


# --------------------------------------------------------------------------- partition methods


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Part boundaries of DeepSpeed's ``partition_method='uniform'`` (deepspeed.runtime.utils, else vendored)."""
    mods = _modules()
    if mods is not None:
        return [int(x) for x in mods[1].partition_uniform(num_items, num_parts)]
    return vendored_partition_uniform(num_items, num_parts)


def partition_balanced(weights: list[float], num_parts: int) -> list[int]:
    """Part boundaries of DeepSpeed's default ``partition_method='parameters'`` (deepspeed.runtime.utils, else vendored)."""
    mods = _modules()
    if mods is not None:
        return [int(x) for x in mods[1].partition_balanced(list(weights), num_parts)]
    return vendored_partition_balanced(weights, num_parts)


def vendored_partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Vendored from DeepSpeed 0.19.8 deepspeed/runtime/utils.py ``partition_uniform``: the first ``residual`` parts one larger."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk = num_items // num_parts
    residual = num_items - chunk * num_parts
    parts = [p * chunk for p in range(num_parts + 1)]
    for i in range(residual):
        for k in range(i + 1, num_parts + 1):
            parts[k] += 1
    return parts


def vendored_partition_balanced(weights: list[float], num_parts: int) -> list[int]:
    """Vendored from DeepSpeed 0.19.8 deepspeed/runtime/utils.py ``partition_balanced``: the DP minimising
    max - min part weight, ties to the later split."""
    n, m = len(weights), num_parts
    if n <= m:
        return vendored_partition_uniform(n, m)
    inf = float("inf")
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0.0] * (n + 1)
    for i, w in enumerate(weights):
        prefix[i + 1] = prefix[i] + float(w)
    dp_max[0][0] = 0
    dp_cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                seg = prefix[i] - prefix[k]
                max_sum = max(dp_max[k][j - 1], seg)
                min_sum = min(dp_min[k][j - 1], seg)
                cost = max_sum - min_sum
                if dp_cost[i][j] >= cost:
                    dp_cost[i][j] = cost
                    dp_max[i][j] = max_sum
                    dp_min[i][j] = min_sum
                    position[i][j] = k
    parts = [n]
    for i in reversed(range(1, m + 1)):
        parts.append(position[parts[-1]][i])
    parts.reverse()
    return parts


# --------------------------------------------------------------------------- type and range checks (no deepspeed)

_NONE = type(None)
#: non-object values DeepSpeed 0.19.8 accepts for a section (zero_optimization's deprecated boolean form; timers is
#: only iterated; null means "absent" for some; expert_parallel is read with a truthiness test first)
NON_OBJECT_OK: dict[str, tuple[type, ...]] = {
    "zero_optimization": (bool,),
    "timers": (str, list),
    "aio": (_NONE,),
    "bf16": (_NONE,),
    "expert_parallel": (list, _NONE, int, float, bool),
}
#: zero_optimization integer fields DeepSpeedZeroConfig bounds below (pydantic gt/ge): (field and alias, bound, strict)
ZERO_BOUNDS = (
    (("reduce_bucket_size",), 0, True),
    (("allgather_bucket_size",), 0, False),
    (("sub_group_size",), 0, False),
    (("prefetch_bucket_size", "stage3_prefetch_bucket_size"), 0, False),
    (("param_persistence_threshold", "stage3_param_persistence_threshold"), 0, False),
    (("model_persistence_threshold", "stage3_model_persistence_threshold"), 0, False),
    (("max_live_parameters", "stage3_max_live_parameters"), 0, False),
    (("max_reuse_distance", "stage3_max_reuse_distance"), 0, False),
    (("zero_hpz_partition_size",), 0, False),
)


def _number(v: Any, integer: bool = False) -> float | None:
    """``v`` as pydantic's lax mode reads a number (numbers and numeric strings; not bools), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        return None
    try:
        x = float(v)
    except ValueError:
        return None
    if integer and isinstance(v, str):
        try:
            int(v.strip())
        except ValueError:
            return None
    return x


def type_problems(cfg: dict[str, Any], sections: tuple[str, ...]) -> list[tuple[tuple[Any, ...], str]]:
    """(key path, message) for values DeepSpeed 0.19.8's DeepSpeedConfig refuses by type or range, checked without
    deepspeed: non-objects where it reads a section (``sections``: the top-level sections of the shipped key table),
    ZeRO's stage and bounded integer fields, fp16's loss scale. A subset of DeepSpeed's checks, used only when
    deepspeed is not importable; tests compare every verdict with DeepSpeedConfig (no false refusals)."""
    out: list[tuple[tuple[Any, ...], str]] = []
    for key in sections:
        if key not in cfg:
            continue
        v = cfg[key]
        if not isinstance(v, dict) and not isinstance(v, NON_OBJECT_OK.get(key, ())):
            out.append(((key,), f"{key} is {v!r}, not a JSON object; DeepSpeedConfig reads it as a section and raises"))
    zero = cfg.get("zero_optimization")
    if isinstance(zero, dict):
        stage = zero.get("stage", 0)
        if not isinstance(stage, bool) and _number(stage, integer=True) not in (0, 1, 2, 3):
            out.append((("zero_optimization", "stage"), f"zero_optimization.stage is {stage!r}; DeepSpeedZeroConfig accepts 0, 1, 2 or 3"))
        for names, bound, strict in ZERO_BOUNDS:
            for name in (n for n in names if n in zero):
                v = zero[name]
                x = float(v) if isinstance(v, bool) else _number(v, integer=True)  # pydantic reads a bool as 0 / 1
                if x is None or not math.isfinite(x) or not x.is_integer() or (x <= bound if strict else x < bound):
                    out.append(
                        (
                            ("zero_optimization", name),
                            f"zero_optimization.{name} is {v!r}; DeepSpeedZeroConfig needs an integer {'>' if strict else '>='} {bound}",
                        )
                    )
    fp16 = cfg.get("fp16")
    if isinstance(fp16, dict) and "loss_scale" in fp16:
        v = fp16["loss_scale"]
        x = _number(v)
        if isinstance(v, bool) or x is None or not math.isfinite(x) or x < 0:
            out.append((("fp16", "loss_scale"), f"fp16.loss_scale is {v!r}; DeepSpeedFP16Config needs a finite number >= 0 (0 = dynamic loss scaling)"))
    return out
