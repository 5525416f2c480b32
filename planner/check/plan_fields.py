"""The fields of plan.json `planner validate` relies on: types, finite numbers and ranges, checked before use.

:func:`plan_problems` returns (key path, message) for every field a tampered or corrupted plan.json gets wrong,
so that validate reports them as findings instead of failing inside arithmetic on them. Pure; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from planner.solve.plan import SCHEMA_VERSION, Layout, Predicted, StagePlan

#: the largest count a plan may hold (GPUs, stages, micro-batches, pieces, a batch size): far above any real
#: cluster, low enough that arithmetic on it stays cheap
MAX_COUNT = 2**31
LAYOUT_COUNTS = ("pp", "tp", "dp", "vp", "micro_batch", "num_microbatches", "global_batch")
STAGE_TIMES = ("time_fwd_s", "time_bwd_s", "time_bwd_weight_s", "time_recompute_s", "send_fwd_s", "send_bwd_s")
DICT_FIELDS = ("layout", "predicted", "inputs", "model", "cluster", "assumptions")
LIST_FIELDS = ("stages", "ranks", "alternatives", "notes")

Problem = tuple[tuple[Any, ...], str]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


class _Checker:
    def __init__(self) -> None:
        self.out: list[Problem] = []

    def bad(self, path: tuple[Any, ...], what: str, value: Any) -> None:
        self.out.append((path, f"plan.json {'.'.join(map(str, path))} must be {what}, not {_shown(value)}"))

    def count(self, d: dict[str, Any], key: str, path: tuple[Any, ...], low: int = 1, high: int = MAX_COUNT, required: bool = True) -> bool:
        """An integer in [low, high]; whether it is one."""
        if key not in d:
            if required:
                self.out.append((path, f"plan.json {'.'.join(map(str, path))} is missing"))
            return False
        v = d[key]
        if not _is_int(v) or not low <= v <= high:
            self.bad(path, f"an integer from {low} to {high}", v)
            return False
        return True

    def number(self, d: dict[str, Any], key: str, path: tuple[Any, ...], positive: bool = False, high: float = math.inf, required: bool = True) -> None:
        """A finite number >= 0 (> 0 with ``positive``), at most ``high``."""
        if key not in d:
            if required:
                self.out.append((path, f"plan.json {'.'.join(map(str, path))} is missing"))
            return
        v = d[key]
        if not _is_num(v) or not math.isfinite(v) or v < 0 or (positive and v == 0) or v > high:
            self.bad(path, f"a finite number {'> 0' if positive else '>= 0'}" + (f" and at most {high:g}" if high < math.inf else ""), v)

    def typed(self, d: dict[str, Any], key: str, path: tuple[Any, ...], kind: type | tuple[Any, ...], what: str, required: bool = True) -> bool:
        if key not in d:
            if required:
                self.out.append((path, f"plan.json {'.'.join(map(str, path))} is missing"))
            return False
        if not isinstance(d[key], kind) or (kind is not bool and isinstance(d[key], bool)):
            self.bad(path, what, d[key])
            return False
        return True


def plan_problems(data: Any) -> list[Problem]:
    """(key path, message) for each field of a plan.json document that is missing, of the wrong type, not finite or
    out of range. [] for a plan the planner wrote."""
    c = _Checker()
    if not isinstance(data, dict):
        return [((), f"plan.json must be a JSON object, not {type(data).__name__}")]
    if data.get("schema_version") != SCHEMA_VERSION:
        return [(("schema_version",), f"plan.json has schema_version {_shown(data.get('schema_version'))}; this planner reads version {SCHEMA_VERSION}")]
    for key in DICT_FIELDS:
        c.typed(data, key, (key,), dict, "a JSON object", required=key in ("layout", "predicted", "inputs"))
    for key in LIST_FIELDS:
        c.typed(data, key, (key,), list, "a JSON array", required=key == "stages")
    if c.out:
        return c.out
    pp, pp_vp = _layout(c, data["layout"])
    _stages(c, data["stages"], pp, pp_vp)
    for i, r in enumerate(data.get("ranks") or []):
        if not isinstance(r, dict):
            c.bad(("ranks", i), "a JSON object", r)
            continue
        c.count(r, "rank", ("ranks", i, "rank"), 0, (pp or MAX_COUNT) - 1)
        _bytes(c, r, ("ranks", i))
    pred = data["predicted"]
    for name in Predicted.__dataclass_fields__:
        c.number(pred, name, ("predicted", name), positive=name == "step_time_s")
    _inputs(c, data["inputs"])
    for i, a in enumerate(data.get("alternatives") or []):
        if not isinstance(a, dict) or not isinstance(a.get("layout"), dict) or not isinstance(a.get("predicted"), (dict, type(None))):
            c.bad(("alternatives", i), "an object with a layout object and a predicted object or null", a)
    groups = (data.get("cluster") or {}).get("groups", [])
    if not isinstance(groups, list):
        c.bad(("cluster", "groups"), "a JSON array", groups)
    else:
        for i, g in enumerate(groups):
            if not isinstance(g, dict):
                c.bad(("cluster", "groups", i), "a JSON object", g)
                continue
            for key in ("nodes", "gpus_per_node"):
                c.count(g, key, ("cluster", "groups", i, key), required=False)
    pieces = (data.get("model") or {}).get("pieces")
    if pieces is not None and not isinstance(pieces, list):
        c.bad(("model", "pieces"), "a JSON array", pieces)
    return c.out


def _layout(c: _Checker, lay: dict[str, Any]) -> tuple[int | None, int | None]:
    """Checks the layout; (pp, pp x vp) when both are valid."""
    valid = [c.count(lay, k, ("layout", k)) for k in LAYOUT_COUNTS]  # every field checked, not only up to the first bad one
    ok = all(valid)
    c.count(lay, "zero", ("layout", "zero"), 0, 3)
    for key in ("engine", "schedule", "recompute"):
        c.typed(lay, key, ("layout", key), str, "a string")
    for key in ("sequence_parallel", "compile"):
        c.typed(lay, key, ("layout", key), bool, "true or false", required=False)
    c.typed(lay, "cp_comm", ("layout", "cp_comm"), str, "a string", required=False)
    extra = sorted(set(lay) - set(Layout.__dataclass_fields__))
    if extra:
        c.out.append((("layout", extra[0]), f"plan.json layout has unknown field {extra[0]!r}"))
    return (lay["pp"], lay["pp"] * lay["vp"]) if ok else (None, None)


def _stages(c: _Checker, stages: list[Any], pp: int | None, pp_vp: int | None) -> None:
    if not stages:
        c.out.append((("stages",), "plan.json stages is empty; a plan has at least one stage"))
        return
    for i, s in enumerate(stages):
        path = ("stages", i)
        if not isinstance(s, dict):
            c.bad(path, "a JSON object", s)
            continue
        missing = sorted(set(StagePlan.__dataclass_fields__) - set(s))
        extra = sorted(set(s) - set(StagePlan.__dataclass_fields__))
        if missing or extra:
            c.out.append((path, f"plan.json stages.{i} " + (f"lacks {', '.join(missing)}" if missing else f"has unknown field {extra[0]!r}")))
            continue
        c.count(s, "index", path + ("index",), 0, (pp_vp or MAX_COUNT) - 1)
        c.count(s, "rank", path + ("rank",), 0, (pp or MAX_COUNT) - 1)
        pieces = s["pieces"]
        if not (isinstance(pieces, list) and len(pieces) == 2 and all(_is_int(p) and 0 <= p <= MAX_COUNT for p in pieces)):
            c.bad(path + ("pieces",), "[start, stop] piece indices", pieces)
        if not (isinstance(s["layers"], list) and len(s["layers"]) == 2 and all(isinstance(x, str) for x in s["layers"])):
            c.bad(path + ("layers",), "[first, last] piece names", s["layers"])
        for key in STAGE_TIMES:
            c.number(s, key, path + (key,))
        c.count(s, "params", path + ("params",), 0, 2**62)
        c.typed(s, "device", path + ("device",), str, "a string")
        _bytes(c, s, path)


def _bytes(c: _Checker, d: dict[str, Any], path: tuple[Any, ...]) -> None:
    c.number(d, "capacity_bytes", path + ("capacity_bytes",))
    if c.typed(d, "memory_bytes", path + ("memory_bytes",), dict, "a JSON object of byte counts"):
        for key in d["memory_bytes"]:
            c.number(d["memory_bytes"], key, path + ("memory_bytes", key))


#: inputs fields validate reads, and what each must be
_INPUTS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "gpus": (lambda v: isinstance(v, str), "a string"),
    "gpus_per_node": (lambda v: v is None or (_is_int(v) and 1 <= v <= MAX_COUNT), "null or a positive integer"),
    "inter_node_gbps": (lambda v: v is None or (_is_num(v) and math.isfinite(v) and v > 0), "null or a finite number > 0"),
    "hardware_profiles": (lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)), "null or a list of paths"),
    "model_file": (lambda v: v is None or isinstance(v, str), "null or a path"),
    "model_args": (lambda v: v is None or isinstance(v, dict), "null or a JSON object"),
    "leaf": (lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)), "null or a list of class names"),
    "dtype": (lambda v: v is None or isinstance(v, str), "null or a string"),
    "tracer": (lambda v: v is None or isinstance(v, str), "null or a string"),
    "optimizer": (lambda v: v is None or isinstance(v, str), "null or a string"),
    "cost_micro_batch": (lambda v: v is None or (_is_int(v) and 1 <= v <= MAX_COUNT), "null or a positive integer"),
    "mem_target": (lambda v: v is None or (_is_num(v) and math.isfinite(v) and 0 < v <= 1), "null or a fraction in (0, 1]"),
}


def _inputs(c: _Checker, inputs: dict[str, Any]) -> None:
    for key, (ok, what) in _INPUTS.items():
        if key in inputs and not ok(inputs[key]):
            c.bad(("inputs", key), what, inputs[key])
