"""DeepSpeed config rules for `planner validate` (torch-free, no DeepSpeed install needed).

Checks a ds_config.json as DeepSpeed 0.19.8 reads it, with the line of every key:

* batch arithmetic, reproducing ``DeepSpeedConfig._set_batch_related_parameters``
  (missing values filled by integer division) and ``_batch_assertion``
  (``train_batch_size == micro * gas * world_size``, all > 0), where under
  pipeline parallelism the world size DeepSpeedConfig sees is the
  data-parallel size, world / (pp x model-parallel) (deepspeed/runtime/config.py;
  /work/shared/reference/engines.md);
* ZeRO stage >= 2 with a pipeline, which ``PipelineEngine.__init__`` refuses only at
  start-up (planner.engines.zero_rules); fp16 with bf16;
* every key at every level against the table of keys DeepSpeed reads
  (:func:`known_keys`), with the closest known key suggested; removed,
  deprecated and accepted-but-unread keys; optimizer/scheduler ``params`` against
  the keyword arguments of the class DeepSpeed builds;
* an ``activation_checkpointing`` section no script applies;
* fewer micro-batches than pipeline stages (planner.engines.schedule_rules) and a
  large 1F1B bubble, (p - 1) / (m + p - 1) > :data:`BUBBLE_WARNING`.

Where the known keys come from (the table ships as data,
``templates/validate/deepspeed_keys_<version>.tsv``, so validation needs no
DeepSpeed install; :func:`extract_key_table` regenerates it from the installed
DeepSpeed with ``python -m planner.check.deepspeed_rules --write``, and
tests/test_validate.py compares the shipped file with a fresh extraction). The
extraction reads DeepSpeed's own code (deepspeed/runtime/config.py and the
modules it calls), without hand-written key lists:

* top-level keys: ``DeepSpeedConfig`` is run on a dict that records every key it
  looks up (``get``, ``[]``, ``in``, ``.keys()``), plus the keys
  ``deepspeed.initialize`` tests on the config dict (deepspeed/__init__.py);
* sections: each key is probed with a sub-dict holding a marker key. When one of
  the pydantic config models (``DeepSpeedConfigModel`` subclasses:
  ``extra="forbid"``) receives it, the section's keys are that model's fields and
  aliases, recursively through nested models, and DeepSpeed refuses unknown keys
  there at start-up. Otherwise the keys the recording sub-dict saw are the
  section's keys, and DeepSpeed silently ignores others (probed recursively);
* ``pipeline``: ``get_pipeline_config`` merges the section over a dict of
  defaults (its keys are accepted), and the pipeline engine reads only what
  deepspeed/runtime/pipe/*.py subscript from ``_config.pipeline`` (the other
  defaults are accepted but never read);
* removed features: ``_REMOVED_TOP_LEVEL_CONFIG_KEYS`` / ``_REMOVED_ZERO_CONFIG_KEYS``
  (DeepSpeedConfig raises DeepSpeedConfigError);
* ``optimizer.params`` / ``scheduler.params``: the keyword arguments of the
  classes ``DeepSpeedEngine`` constructs for each optimizer / scheduler type
  (it calls them with ``**params``, so an unknown key is a TypeError), plus the
  keys the engine pops first.

Torch-free at validation time: only the generator imports DeepSpeed (and torch).
"""

from __future__ import annotations

import ast
import difflib
import inspect
import json
import re
import sys
import typing
from bisect import bisect_right
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from planner.check.findings import Finding
from planner.errors import close_matches

# --------------------------------------------------------------------------- known keys (data)

DEEPSPEED_VERSION = "0.19.8"
TABLE_NAME = f"deepspeed_keys_{DEEPSPEED_VERSION}.tsv"

#: kinds of rows in the table
VALUE, SECTION, UNREAD, DEPRECATED, REMOVED = "value", "section", "unread", "deprecated", "removed"
#: section policies: DeepSpeed refuses unknown keys (pydantic extra="forbid"), silently ignores them,
#: or passes them as keyword arguments to a constructor (TypeError at deepspeed.initialize)
FORBID, IGNORE, KWARGS = "forbid", "ignore", "kwargs"

#: optimizer types DeepSpeed builds itself (lower-cased names, deepspeed/runtime/config.py DEEPSPEED_OPTIMIZERS)
#: -> the classes ``DeepSpeedEngine._configure_basic_optimizer`` may construct with ``**params``
OPTIMIZER_CLASSES: dict[str, tuple[str, ...]] = {
    "adam": ("deepspeed.ops.adam.FusedAdam", "deepspeed.ops.adam.DeepSpeedCPUAdam", "torch.optim.Adam", "torch.optim.AdamW"),
    "adamw": ("deepspeed.ops.adam.FusedAdam", "deepspeed.ops.adam.DeepSpeedCPUAdam", "torch.optim.AdamW"),
    "lamb": ("deepspeed.ops.lamb.FusedLamb",),
    "lion": ("deepspeed.ops.lion.FusedLion", "deepspeed.ops.lion.DeepSpeedCPULion"),
    "adagrad": ("torch.optim.Adagrad", "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad"),
}

PROBE = "__planner_probe__"


@dataclass(frozen=True)
class KeyInfo:
    kind: str  # value | section | unread | deprecated | removed
    note: str = ""  # section: its policy; deprecated: the replacement; removed/unread: why


@dataclass
class KeyTable:
    """Known keys per section path ("" = top level, "zero_optimization.offload_optimizer", "optimizer.params:adam")."""

    sections: dict[str, dict[str, KeyInfo]] = field(default_factory=dict)
    policy: dict[str, str] = field(default_factory=dict)

    def add(self, section: str, key: str, info: KeyInfo) -> None:
        keys = self.sections.setdefault(section, {})
        old = keys.get(key)
        if old is None or (old.kind == VALUE and info.kind != VALUE):
            keys[key] = info
        if info.kind == SECTION:
            sub = join(section, key)
            self.sections.setdefault(sub, {})
            self.policy.setdefault(sub, info.note)

    def rows(self) -> list[tuple[str, str, str, str]]:
        return sorted((s, k, i.kind, i.note) for s, keys in self.sections.items() for k, i in keys.items())


def join(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


# --------------------------------------------------------------------------- the shipped table


def table_path() -> Path:
    from planner.resources import templates_dir

    return Path(templates_dir()) / "validate" / TABLE_NAME


def format_table(table: KeyTable) -> str:
    head = [
        f"# DeepSpeed {DEEPSPEED_VERSION} configuration keys, generated from its sources by",
        "# `python -m planner.check.deepspeed_rules --write` (planner/check/deepspeed_rules.py). Do not edit.",
        "# section\tkey\tkind\tnote",
    ]
    body = ["\t".join(_clean(x) for x in row) for row in table.rows()]
    return "\n".join(head + body) + "\n"


def _clean(text: str) -> str:
    return " ".join(str(text).split())


def parse_table(text: str) -> KeyTable:
    table = KeyTable()
    table.policy[""] = IGNORE
    for raw in text.splitlines():
        if not raw or raw.startswith("#"):
            continue
        section, key, kind, note = (raw.split("\t") + ["", "", "", ""])[:4]
        if ":" in section:  # optimizer.params:<type>, scheduler.params:<type>
            table.policy[section] = KWARGS
        table.add(section, key, KeyInfo(kind, note))
    return table


@lru_cache(maxsize=1)
def known_keys() -> KeyTable:
    """The shipped table (an empty table when the data file is missing: key checks are then skipped)."""
    path = table_path()
    if not path.is_file():
        return KeyTable()
    return parse_table(path.read_text())


# --------------------------------------------------------------------------- extraction from DeepSpeed


class _Recording(dict):
    """A dict that records every key looked up in it."""

    def __init__(self, *args: Any, log: set | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.log: set = log if log is not None else set()

    def get(self, key, default=None):
        self.log.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.log.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.log.add(key)
        return super().__contains__(key)

    def keys(self):
        outer = self

        class _Keys:
            def __contains__(self, key):
                outer.log.add(key)
                return dict.__contains__(outer, key)

            def __iter__(self):
                return iter(dict.keys(outer))

            def __len__(self):
                return dict.__len__(outer)

        return _Keys()


#: sub-dicts that make DeepSpeed read further into a section while probing (e.g. optimizer.params is read only
#: when optimizer.type is set)
_SEEDS: dict[str, dict[str, Any]] = {"optimizer": {"type": "Adam"}, "scheduler": {"type": "WarmupLR"}}


def _model_classes(annotation: Any) -> list[type]:
    from pydantic import BaseModel

    out = []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    for arg in typing.get_args(annotation):
        out.extend(_model_classes(arg))
    return out


def _add_model(table: KeyTable, section: str, cls: type, depth: int = 0) -> None:
    extra = (getattr(cls, "model_config", {}) or {}).get("extra")
    table.policy[section] = FORBID if extra == "forbid" else IGNORE
    table.sections.setdefault(section, {})
    for name, f in cls.model_fields.items():
        extra_info = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        names = [name] + [a for a in (f.alias, f.validation_alias if isinstance(f.validation_alias, str) else None) if a and a != name]
        models = _model_classes(f.annotation)
        for key in names:
            if extra_info.get("deprecated"):
                table.add(section, key, KeyInfo(DEPRECATED, str(extra_info.get("new_param", ""))))
            elif models and depth < 6:
                sub_extra = (getattr(models[0], "model_config", {}) or {}).get("extra")
                table.add(section, key, KeyInfo(SECTION, FORBID if sub_extra == "forbid" else IGNORE))
                _add_model(table, join(section, key), models[0], depth + 1)
            else:
                table.add(section, key, KeyInfo(VALUE))


def _nested(path: list[str], leaf: dict) -> dict:
    """{path[0]: {... path[-1]: leaf}} with probing seeds merged in along the way."""
    out: Any = leaf
    for i in range(len(path) - 1, -1, -1):
        seed = dict(_SEEDS.get(".".join(path[: i + 1]), {})) if i < len(path) - 1 else {}
        if i < len(path) - 1:
            seed.update(out)
            out = seed
        out = {path[i]: out}
    return out


def _probe(C, hits: list, path: list[str]) -> tuple[list, set]:
    """Run DeepSpeedConfig with a marker sub-dict at ``path``; the pydantic models that received it and the keys read."""
    sub: set = set()
    leaf = _Recording({**_SEEDS.get(".".join(path), {}), PROBE: 1}, log=sub)
    cfg = _nested(path, leaf)
    cfg.setdefault("train_batch_size", 1)
    hits.clear()
    try:
        C.DeepSpeedConfig(_Recording(cfg))
    except Exception:  # noqa: BLE001 - probing: most markers make DeepSpeed raise after reading
        pass
    return list(hits), sub - {PROBE}


def _ast_keys_of(tree: ast.AST, names: set[str], func: str | None = None) -> set[str]:
    """String keys tested or subscripted on a variable called one of ``names`` (``"k" in config``, ``config["k"]``)."""
    out: set[str] = set()
    roots = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == func] if func else [tree]
    for root in roots:
        for node in ast.walk(root):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str):
                if any(isinstance(op, ast.In) for op in node.ops) and any(isinstance(c, ast.Name) and c.id in names for c in node.comparators):
                    out.add(node.left.value)
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in names:
                if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                    out.add(node.slice.value)
    return out


def _pipeline_keys(ds_root: Path) -> tuple[set[str], set[str]]:
    """(keys get_pipeline_config accepts as defaults, keys the pipeline engine reads from _config.pipeline)."""
    tree = ast.parse((ds_root / "runtime" / "config.py").read_text())
    defaults: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "get_pipeline_config":
            for sub in ast.walk(node):
                if isinstance(sub, ast.Dict):
                    defaults |= {k.value for k in sub.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    read: set[str] = set()
    for py in sorted((ds_root / "runtime" / "pipe").glob("*.py")):
        for node in ast.walk(ast.parse(py.read_text())):
            target, key = None, None
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                target, key = node.value, node.slice.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
                if isinstance(node.args[0], ast.Constant):
                    target, key = node.func.value, node.args[0].value
            if target is not None and isinstance(key, str) and ast.unparse(target).endswith("_config.pipeline"):
                read.add(key)
    return defaults, read


def _engine_optimizer_keys(ds_root: Path) -> tuple[set[str], set[str]]:
    """(keys DeepSpeedEngine pops from optimizer.params before calling the optimizer class, keys it passes itself).

    Read from deepspeed/runtime/engine.py: ``optimizer_parameters.pop(KEY, ...)`` anywhere, and the dict keys that
    ``get_optimizer_configuration`` returns as extra keyword arguments for the Adam classes.
    """
    import deepspeed.runtime.engine as engine

    def name_of(arg: ast.AST) -> str | None:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.Name) and isinstance(getattr(engine, arg.id, None), str):
            return getattr(engine, arg.id)
        return None

    tree = ast.parse((ds_root / "runtime" / "engine.py").read_text())
    popped: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "pop" and node.args:
            if ast.unparse(node.func.value) == "optimizer_parameters" and name_of(node.args[0]):
                popped.add(name_of(node.args[0]))  # type: ignore[arg-type]
    passed: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "get_optimizer_configuration":
            for sub in ast.walk(node):
                if isinstance(sub, ast.Dict):
                    passed |= {n for n in (name_of(k) for k in sub.keys if k is not None) if n}
                elif isinstance(sub, ast.Subscript) and isinstance(sub.ctx, ast.Store) and name_of(sub.slice):
                    passed.add(name_of(sub.slice))  # type: ignore[arg-type]
    return popped, passed


def _kwargs_of(path: str) -> set[str]:
    import importlib

    mod, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(mod), name)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return {p.name for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}  # params[0]: the parameters / optimizer


def extract_key_table() -> KeyTable:
    """Build the key table from the installed DeepSpeed (imports deepspeed and torch)."""
    import logging

    import deepspeed
    import deepspeed.runtime.config as C
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    logging.getLogger("DeepSpeed").setLevel(logging.CRITICAL)
    ds_root = Path(deepspeed.__file__).parent
    table = KeyTable()
    table.policy[""] = IGNORE
    hits: list = []
    original = DeepSpeedConfigModel.__init__

    def recording_init(self, strict=False, **data):
        if PROBE in data:
            hits.append((type(self), None))
        for k, v in data.items():
            if isinstance(v, dict) and PROBE in v:
                hits.append((type(self), k))
        return original(self, strict=strict, **data)

    DeepSpeedConfigModel.__init__ = recording_init
    try:
        log: set = set()
        C.DeepSpeedConfig(_Recording({"train_batch_size": 1}, log=log))
        init_tree = ast.parse((ds_root / "__init__.py").read_text())
        log |= _ast_keys_of(init_tree, {"config"}, func="initialize")
        log |= _ast_keys_of(ast.parse((ds_root / "runtime" / "config.py").read_text()), {"config"})
        removed_top = dict(getattr(C, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}))
        removed_zero = dict(getattr(C, "_REMOVED_ZERO_CONFIG_KEYS", {}))
        for key in sorted(log):
            if not isinstance(key, str):
                continue
            if key in removed_top:
                table.add("", key, KeyInfo(REMOVED, removed_top[key]))
            elif key != "pipeline":
                _classify(C, table, hits, [key], set(removed_zero))
        defaults, read = _pipeline_keys(ds_root)
        table.add("", "pipeline", KeyInfo(SECTION, IGNORE))
        for key in sorted(defaults | read):
            if key in read:
                table.add("pipeline", key, KeyInfo(VALUE))
            else:
                table.add("pipeline", key, KeyInfo(UNREAD, "accepted by get_pipeline_config but never read by the pipeline engine"))
        for key, message in removed_zero.items():
            table.add("zero_optimization", key, KeyInfo(REMOVED, message))
    finally:
        DeepSpeedConfigModel.__init__ = original
    _optimizer_and_scheduler_params(table, ds_root)
    for k in sorted(_kwargs_of("deepspeed.pipe.PipelineModule") | {"layers"}):  # not config keys: hints for misplaced ones
        table.add("pipeline:module_args", k, KeyInfo(VALUE, "argument of deepspeed.pipe.PipelineModule"))
    return table


def _classify(C, table: KeyTable, hits: list, path: list[str], skip: set[str], depth: int = 0) -> None:
    section, key = ".".join(path[:-1]), path[-1]
    found, sub = _probe(C, hits, path)
    if found:
        cls, fld = next(((c, f) for c, f in found if f is None), found[0])
        if fld is not None:
            models = _model_classes(cls.model_fields[fld].annotation) if fld in cls.model_fields else []
            if not models:
                table.add(section, key, KeyInfo(VALUE))
                return
            cls = models[0]
        extra = (getattr(cls, "model_config", {}) or {}).get("extra")
        table.add(section, key, KeyInfo(SECTION, FORBID if extra == "forbid" else IGNORE))
        _add_model(table, ".".join(path), cls)
        return
    sub = {k for k in sub if isinstance(k, str) and k not in skip}
    if not sub or depth >= 4:
        table.add(section, key, KeyInfo(VALUE))
        return
    table.add(section, key, KeyInfo(SECTION, IGNORE))
    for k in sorted(sub):
        _classify(C, table, hits, path + [k], set(), depth + 1)


def _optimizer_and_scheduler_params(table: KeyTable, ds_root: Path) -> None:
    import torch
    import deepspeed.runtime.config as C
    import deepspeed.runtime.lr_schedules as lr_schedules

    popped, passed = _engine_optimizer_keys(ds_root)
    ds_names = [str(n) for n in getattr(C, "DEEPSPEED_OPTIMIZERS", [])]
    for name in ds_names:  # optimizer.type values DeepSpeed lower-cases and builds itself
        table.add("optimizer:types", name, KeyInfo(VALUE, "built by DeepSpeed"))
    for name, classes in OPTIMIZER_CLASSES.items():
        if name not in ds_names:
            continue
        sec = f"optimizer.params:{name}"
        table.policy[sec] = KWARGS
        keys: set[str] = set()
        for cls in classes:
            keys |= _kwargs_of(cls)
        if name in ("adam", "adamw"):  # get_optimizer_configuration pops some keys and passes others itself
            keys = (keys | popped) - (passed - popped)
        for k in sorted(keys):
            table.add(sec, k, KeyInfo(VALUE))
    for name in sorted(getattr(torch.optim, "__all__", [])):
        cls = getattr(torch.optim, name, None)
        if name.lower() in ds_names:  # "Adam" means DeepSpeed's adam, not torch.optim.Adam
            continue
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer:
            sec = f"optimizer.params:{name}"
            table.policy[sec] = KWARGS
            for k in sorted(_kwargs_of(f"torch.optim.{name}")):
                table.add(sec, k, KeyInfo(VALUE))
    for name in lr_schedules.VALID_LR_SCHEDULES:
        sec = f"scheduler.params:{name}"
        table.policy[sec] = KWARGS
        for k in sorted(_kwargs_of(f"deepspeed.runtime.lr_schedules.{name}")):
            table.add(sec, k, KeyInfo(VALUE))

#: warn when the 1F1B bubble fraction (p - 1) / (m + p - 1) exceeds this
BUBBLE_WARNING = 0.25
#: a difflib ratio at least this high makes an unknown key a likely misspelling (error) rather than a stray key
MISSPELLING_RATIO = 0.8

RULES: dict[str, tuple[str, str]] = {
    "DS001": ("error", "batch sizes do not satisfy DeepSpeed's train_batch_size = micro x gas x data-parallel size"),
    "DS002": ("error", "ZeRO stage 2 or 3 with pipeline parallelism (PipelineEngine refuses it at start-up)"),
    "DS003": ("error", "fp16 and bf16 both enabled"),
    "DS004": ("error", "unknown key in a section DeepSpeed validates strictly (refused at start-up)"),
    "DS005": ("error", "unknown key that looks like a misspelling of a known one (DeepSpeed silently ignores it)"),
    "DS006": ("warning", "unknown key (DeepSpeed silently ignores it)"),
    "DS007": ("warning", "setting with no effect (accepted but never read, or a PipelineModule argument)"),
    "DS008": ("warning", "activation_checkpointing section that no training script applies"),
    "DS009": ("warning", "deprecated key"),
    "DS010": ("error", "key of a feature DeepSpeed removed (DeepSpeedConfig raises)"),
    "DS011": ("error", "fewer micro-batches (gradient_accumulation_steps) than pipeline stages"),
    "DS012": ("warning", f"large pipeline bubble: (p - 1) / (m + p - 1) > {BUBBLE_WARNING:.0%} with 1F1B"),
    "DS013": ("info", "world size or pipeline depth unknown: batch checks limited"),
    "DS014": ("error", "not a valid JSON object, or a key given twice"),
    "DS015": ("error", "optimizer or scheduler DeepSpeed cannot build from the config (unknown type, or params its class does not accept)"),
}


# --------------------------------------------------------------------------- JSON with key lines


class JsonError(ValueError):
    def __init__(self, message: str, line: int | None):
        super().__init__(message)
        self.line = line


@dataclass
class JsonDoc:
    value: Any
    lines: dict[tuple, int]  # key path -> 1-based line where the key is written
    duplicates: list[tuple[tuple, int, int]]  # (path, line, line of the first occurrence)

    def line(self, *path: Any) -> int | None:
        """Line of the deepest written prefix of ``path``."""
        p = tuple(path)
        while p:
            if p in self.lines:
                return self.lines[p]
            p = p[:-1]
        return None


_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_WS = re.compile(r"[ \t\n\r]*")


def parse_json(text: str) -> JsonDoc:
    """Parse JSON, keeping each object key's line and every duplicated key. Raises JsonError."""
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        raise JsonError(f"not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})", e.lineno) from None
    starts = [0] + [m.end() for m in re.finditer("\n", text)]
    lines: dict[tuple, int] = {}
    dups: list[tuple[tuple, int, int]] = []
    decoder = json.JSONDecoder()

    def line_of(pos: int) -> int:
        return bisect_right(starts, pos)

    def ws(i: int) -> int:
        return _WS.match(text, i).end()  # type: ignore[union-attr]

    def value(i: int, path: tuple) -> tuple[Any, int]:
        i = ws(i)
        c = text[i]
        if c == "{":
            obj: dict = {}
            i = ws(i + 1)
            if text[i] == "}":
                return obj, i + 1
            while True:
                i = ws(i)
                key, j = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
                kline = line_of(i)
                i = ws(j)
                assert text[i] == ":"
                v, i = value(i + 1, path + (key,))
                if key in obj:
                    dups.append((path + (key,), kline, lines.get(path + (key,), kline)))
                else:
                    lines[path + (key,)] = kline
                obj[key] = v
                i = ws(i)
                if text[i] == ",":
                    i += 1
                    continue
                assert text[i] == "}"
                return obj, i + 1
        if c == "[":
            arr: list = []
            i = ws(i + 1)
            if text[i] == "]":
                return arr, i + 1
            while True:
                v, i = value(i, path + (len(arr),))
                arr.append(v)
                i = ws(i)
                if text[i] == ",":
                    i += 1
                    continue
                assert text[i] == "]"
                return arr, i + 1
        v, j = decoder.raw_decode(text, i)
        return v, j

    val, _ = value(0, ())
    return JsonDoc(val, lines, dups)


# --------------------------------------------------------------------------- DeepSpeed's batch arithmetic


class BatchError(ValueError):
    """DeepSpeedConfig would raise for these batch values (the message says what it asserts)."""


def deepspeed_batch(train_batch: Any, micro_batch: Any, grad_acc: Any, world_size: int) -> tuple[Any, Any, Any]:
    """(train_batch_size, micro, gas) as DeepSpeedConfig fills and checks them for ``world_size`` data-parallel ranks.

    Same statements, in the same order, as ``_set_batch_related_parameters`` and ``_batch_assertion``
    (deepspeed/runtime/config.py, DeepSpeed 0.19.8); raises :class:`BatchError` where DeepSpeed raises.
    """
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
            raise BatchError("either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")
        if not train_batch > 0:
            raise BatchError(f"train_batch_size {train_batch} has to be greater than 0")
        if not micro_batch > 0:
            raise BatchError(f"train_micro_batch_size_per_gpu {micro_batch} has to be greater than 0")
        if not grad_acc > 0:
            raise BatchError(f"gradient_accumulation_steps {grad_acc} has to be greater than 0")
        if train_batch != micro_batch * grad_acc * world_size:
            raise BatchError(
                f"train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size: "
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


def bubble_1f1b(p: int, m: int) -> float:
    """Idle fraction of a 1F1B (or GPipe) pipeline with equal stages: (p - 1) / (m + p - 1)."""
    return (p - 1) / (m + p - 1)


# --------------------------------------------------------------------------- DeepSpeed's partition methods


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """deepspeed.runtime.utils.partition_uniform: part boundaries, the first ``residual`` parts one item larger."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk = num_items // num_parts
    residual = num_items - chunk * num_parts
    parts = [p * chunk for p in range(num_parts + 1)]
    for i in range(residual):
        for k in range(i + 1, num_parts + 1):
            parts[k] += 1
    return parts


def partition_balanced(weights: list[float], num_parts: int) -> list[int]:
    """deepspeed.runtime.utils.partition_balanced ('parameters' method): the same DP (min of max - min part weight,
    ties to the later split), so the boundaries are DeepSpeed's for the same weights."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
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


# --------------------------------------------------------------------------- the checks


@dataclass(frozen=True)
class DSContext:
    """What the config itself cannot say: the cluster and pipeline it runs on, and the scripts beside it."""

    file: str
    world_size: int | None = None  # GPUs (processes)
    world_source: str = ""  # where the world size came from, for messages ("--gpus 8xA100", "plan.json")
    pp: int | None = None  # pipeline stages
    pp_source: str = ""
    mp: int = 1  # model (tensor) parallel size: DeepSpeed's data-parallel size is world / (pp x mp)
    scripts: tuple[str, ...] = ()  # Python files beside the config
    applies_checkpointing: bool = False  # one of them calls deepspeed.checkpointing.configure
    planned: tuple[int, int] | None = None  # (pp, micro-batches) plan.json chose after simulating the schedule


@dataclass
class DSConfig:
    """What the checks read from the config (for cross-file and memory checks); None where not stated or not valid."""

    doc: JsonDoc | None = None
    train_batch: int | None = None  # after DeepSpeed's filling, when it succeeded
    micro_batch: int | None = None
    grad_acc: int | None = None
    zero: int | None = None
    precision: str | None = None  # bf16 | fp16 | fp32
    checkpoint_interval: int | None = None  # pipeline.activation_checkpoint_interval
    has_pipeline_section: bool = False
    findings: list[Finding] = field(default_factory=list)


def _truthy(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("true", "1", "yes", "on", "t", "y")
    return v is True or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 1)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


class _Checker:
    def __init__(self, doc: JsonDoc, ctx: DSContext, table: KeyTable):
        self.doc, self.ctx, self.table = doc, ctx, table
        self.cfg: dict = doc.value
        self.out: list[Finding] = []

    def add(self, rule: str, path: tuple | None, message: str, fix: str) -> None:
        line = self.doc.line(*path) if path else None
        self.out.append(Finding(rule, RULES[rule][0], self.ctx.file, line or 1, message, fix))  # type: ignore[arg-type]

    # keys -------------------------------------------------------------------
    def keys(self) -> None:
        for path, line, first in self.doc.duplicates:
            self.out.append(
                Finding(
                    "DS014", "error", self.ctx.file, line,
                    f"{_dotted(path)} is given twice (first on line {first}); DeepSpeed's loader refuses duplicate keys (dict_raise_error_on_duplicate_keys).",
                    "keep one of them",
                )
            )
        if not self.table.sections:
            return
        self.walk(self.cfg, (), "")

    def walk(self, obj: dict, path: tuple, section: str) -> None:
        known = self.table.sections.get(section)
        if known is None:
            return
        policy = self.table.policy.get(section, "ignore")
        for key, val in obj.items():
            here = path + (key,)
            info = known.get(key)
            if info is None:
                self.unknown(here, key, section, policy, known)
                continue
            if info.kind == REMOVED:
                self.add("DS010", here, f"{_dotted(here)}: {info.note}", f"remove {key!r}")
            elif info.kind == DEPRECATED:
                self.add(
                    "DS009", here,
                    f"{_dotted(here)} is deprecated in DeepSpeed {DEEPSPEED_VERSION}" + (f"; it is replaced by {info.note!r}" if info.note else "") + " (DeepSpeed logs a warning).",
                    f"use {info.note!r} instead" if info.note else "remove it",
                )
            elif info.kind == UNREAD:
                self.unread(here, key)
            if here == ("optimizer", "params") or here == ("scheduler", "params"):
                self.params(here, val)
            elif info.kind == SECTION and isinstance(val, dict):
                self.walk(val, here, f"{section}.{key}" if section else key)

    def unknown(self, here: tuple, key: str, section: str, policy: str, known: dict) -> None:
        candidates = [k for k, i in known.items() if i.kind not in (REMOVED,)]
        where = f"the {section} section" if section else "the top level"
        if policy == FORBID:
            hits = close_matches(key, candidates)
            self.add(
                "DS004", here,
                f"{_dotted(here)} is not a key of {where} in DeepSpeed {DEEPSPEED_VERSION}; DeepSpeed refuses the config at start-up "
                "(pydantic: 'Extra inputs are not permitted').",
                f"did you mean {' or '.join(repr(h) for h in hits)}?" if hits else f"remove it; known keys: {', '.join(sorted(candidates)[:12])}",
            )
            return
        module_args = self.table.sections.get("pipeline:module_args", {})
        if section == "pipeline" and key in module_args:
            self.add(
                "DS007", here,
                f"pipeline.{key} is an argument of deepspeed.pipe.PipelineModule, not a config key: DeepSpeed never reads it from the config.",
                f"pass {key}=... to PipelineModule(...) in the training script, and remove it here",
            )
            return
        best = difflib.get_close_matches(key, candidates, n=1, cutoff=MISSPELLING_RATIO)
        if best:
            self.add(
                "DS005", here,
                f"{_dotted(here)} is not a key of {where} in DeepSpeed {DEEPSPEED_VERSION}; DeepSpeed silently ignores it, so the setting has no effect. "
                f"Did you mean {best[0]!r}?",
                f"rename it to {best[0]!r}",
            )
            return
        hits = close_matches(key, candidates)
        self.add(
            "DS006", here,
            f"{_dotted(here)} is not a key of {where} in DeepSpeed {DEEPSPEED_VERSION}; DeepSpeed silently ignores it."
            + (f" Closest known: {', '.join(repr(h) for h in hits)}." if hits else ""),
            "remove it (or keep it if your own code reads it)",
        )

    def unread(self, here: tuple, key: str) -> None:
        module_args = self.table.sections.get("pipeline:module_args", {})
        arg = difflib.get_close_matches(key, list(module_args), n=1, cutoff=0.6) if here[0] == "pipeline" else []
        self.add(
            "DS007", here,
            f"{_dotted(here)} is accepted but never read by DeepSpeed {DEEPSPEED_VERSION}'s pipeline engine: it has no effect."
            + (f" The PipelineModule argument {arg[0]!r} is what sets it." if arg else ""),
            (f"pass {arg[0]}=... to PipelineModule(...) and remove it here" if arg else "remove it"),
        )

    def params(self, here: tuple, val: Any) -> None:
        owner = self.cfg.get(here[0])
        if not isinstance(val, dict) or not isinstance(owner, dict):
            return
        kind = owner.get("type")
        if not isinstance(kind, str):
            return
        if here[0] == "optimizer" and kind.lower() in self.table.sections.get("optimizer:types", {}):
            kind = kind.lower()
        if self.table.sections.get(f"{here[0]}.params:{kind}") is None and here[0] == "optimizer" and kind not in self.table.sections.get("optimizer:types", {}):
            return  # an unknown type is reported once, by optimizer_type()
        if here[0] == "optimizer" and "max_grad_norm" in val:
            self.add(
                "DS015", here + ("max_grad_norm",),
                "optimizer.params.max_grad_norm: DeepSpeedEngine raises ValueError ('max_grad_norm' is not supported as an optimizer parameter).",
                "use the top-level 'gradient_clipping' instead",
            )
        known = self.table.sections.get(f"{here[0]}.params:{kind}")
        if known is None:
            return
        for key in val:
            if key in known or (here[0] == "optimizer" and key == "max_grad_norm"):
                continue
            hits = close_matches(key, known)
            self.add(
                "DS015", here + (key,),
                f"{_dotted(here + (key,))} is not an argument of the {kind!r} {here[0]} DeepSpeed builds from this config "
                f"(it calls the class with **params): deepspeed.initialize fails with TypeError (unless the script passes its own {here[0]}).",
                f"did you mean {' or '.join(repr(h) for h in hits)}?" if hits else "remove it",
            )

    def optimizer_type(self) -> None:
        opt = self.cfg.get("optimizer")
        types = self.table.sections.get("optimizer:types", {})
        if not isinstance(opt, dict) or not isinstance(opt.get("type"), str) or not types:
            return
        kind = opt["type"]
        torch_names = [s.split(":", 1)[1] for s in self.table.sections if s.startswith("optimizer.params:") and s.split(":", 1)[1] not in types]
        if kind.lower() in types or kind in torch_names:
            return
        hits = close_matches(kind, sorted(types) + sorted(torch_names))
        self.add(
            "DS015", ("optimizer", "type"),
            f"optimizer.type {kind!r} is neither one of DeepSpeed's optimizers ({', '.join(sorted(types))}) nor a torch.optim class: "
            "DeepSpeedEngine asserts it 'is not a supported DeepSpeed Optimizer' (unless the script passes its own optimizer).",
            f"did you mean {' or '.join(repr(h) for h in hits)}?" if hits else "use a supported type",
        )

    # precision --------------------------------------------------------------
    def precision(self) -> str | None:
        fp16 = self.cfg.get("fp16") if isinstance(self.cfg.get("fp16"), dict) else {}
        bkey = "bf16" if self.cfg.get("bf16") is not None else "bfloat16"
        bf16 = self.cfg.get(bkey) if isinstance(self.cfg.get(bkey), dict) else {}
        on16, onbf = _truthy(fp16.get("enabled")), _truthy(bf16.get("enabled"))
        if on16 and onbf:
            self.add("DS003", (bkey, "enabled"), "fp16 and bf16 are both enabled; DeepSpeedConfig asserts 'bfloat16 and fp16 modes cannot be simultaneously enabled'.", "enable one of them")
            return None
        if "auto" in (fp16.get("enabled"), bf16.get("enabled")):
            return None
        return "bf16" if onbf else "fp16" if on16 else "fp32"

    # ZeRO -----------------------------------------------------------------
    def zero(self, pipelined: bool | None) -> int | None:
        z = self.cfg.get("zero_optimization")
        stage = z.get("stage", 0) if isinstance(z, dict) else 0
        if isinstance(stage, str) and stage.isdigit():
            stage = int(stage)
        if not isinstance(stage, int) or isinstance(stage, bool):
            return None
        if stage >= 2 and pipelined is not False:
            from planner.engines import zero_rules

            known_pp = self.ctx.pp is not None and self.ctx.pp > 1
            because = f"pipeline parallelism (pp = {self.ctx.pp}, from {self.ctx.pp_source})" if known_pp else "a pipeline section (pipeline parallelism)"
            reason = zero_rules("deepspeed", stage, self.ctx.pp if known_pp else 2)
            self.add(
                "DS002", ("zero_optimization", "stage"),
                f"ZeRO stage {stage} with {because}: {reason[0] if reason else 'refused by PipelineEngine'}. DeepSpeedConfig alone accepts it, "
                "so the job fails only at launch, in PipelineEngine.__init__ (deepspeed/runtime/pipe/engine.py).",
                "use zero_optimization.stage 0 or 1 with a pipeline (stage 1 partitions the optimizer state)",
            )
        return stage

    # batch ----------------------------------------------------------------
    def batch(self, result: DSConfig) -> None:
        names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        vals = [self.cfg.get(n) for n in names]
        line_key = next((n for n, v in zip(names, vals) if v is not None), names[0])
        if any(v == "auto" for v in vals):
            self.add(
                "DS013", (line_key,),
                "batch values are 'auto': Hugging Face's Trainer fills them before DeepSpeed sees the config, so they are not checked here.",
                "give numbers to check the batch arithmetic",
            )
            return
        bad = [n for n, v in zip(names, vals) if v is not None and not _num(v)]
        if bad:
            self.add("DS001", (bad[0],), f"{bad[0]} is {self.cfg.get(bad[0])!r}, not a number; DeepSpeed's batch arithmetic fails on it.", "write a positive integer")
            return
        ctx = self.ctx
        tbs, mb, gas = vals
        world = ctx.world_size
        if world is not None and ctx.pp is not None:
            model = ctx.pp * ctx.mp
            if world % model:
                return  # reported where world and pp are compared (PLAN004 / usage error)
            dp = world // model
            try:
                result.train_batch, result.micro_batch, result.grad_acc = deepspeed_batch(tbs, mb, gas, dp)
            except BatchError as e:
                self.add(
                    "DS001", (line_key if tbs is None else "train_batch_size",),
                    f"DeepSpeedConfig fails: {e} (data-parallel size {dp} = {world} GPUs [{ctx.world_source}] / (pp {ctx.pp} [{ctx.pp_source}] x model-parallel {ctx.mp})).",
                    self.batch_fix(dp),
                )
            return
        # unknown data-parallel size: what holds for every possible one
        if tbs is not None and mb is not None and gas is not None:
            nonpositive = [(n, v) for n, v in zip(names, vals) if v <= 0]
            if nonpositive:
                n, v = nonpositive[0]
                self.add("DS001", (n,), f"DeepSpeedConfig fails for any number of GPUs: {n} {v} has to be greater than 0.", f"give {n} a positive value")
                return
            need = tbs / (mb * gas)
            if need != int(need):
                self.add(
                    "DS001", ("train_batch_size",),
                    f"train_batch_size {tbs} is not a multiple of micro {mb} x gas {gas} = {mb * gas}: no data-parallel size satisfies DeepSpeed's "
                    "train_batch_size == micro x gas x data-parallel size.",
                    f"use a multiple of {mb * gas} (e.g. {mb * gas * max(1, round(need))})",
                )
                return
            need = int(need)
            if world is not None:
                options = sorted(world // (k * ctx.mp) for k in range(1, world + 1) if world % (k * ctx.mp) == 0)
                if need not in options:
                    self.add(
                        "DS001", ("train_batch_size",),
                        f"train_batch_size {tbs} = micro {mb} x gas {gas} x {need} needs a data-parallel size of {need}, which no pipeline depth "
                        f"gives on {world} GPUs [{ctx.world_source}] (possible data-parallel sizes: {', '.join(map(str, options))}).",
                        f"make train_batch_size = {mb * gas} x the data-parallel size",
                    )
                    return
                self.add(
                    "DS013", ("train_batch_size",),
                    f"the pipeline depth is unknown; the batch sizes hold only with a data-parallel size of {need} "
                    f"(pp x model-parallel = {world // need} on {world} GPUs).",
                    "pass --pp, or validate the plan directory with its plan.json",
                )
                return
            self.add(
                "DS013", ("train_batch_size",),
                f"the number of GPUs is unknown; the batch sizes hold only with a data-parallel size of {need}.",
                "pass --gpus (and --pp), or validate the plan directory with its plan.json",
            )
            return
        missing = [n for n, v in zip(names, vals) if v is None]
        if tbs is None and mb is None:
            self.add("DS001", (line_key,), "DeepSpeedConfig fails: either train_batch_size or train_micro_batch_size_per_gpu needs to be provided.", "give train_batch_size and train_micro_batch_size_per_gpu")
            return
        what = "the number of GPUs" if world is None else "the pipeline depth"
        self.add(
            "DS013", (line_key,),
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} filled by DeepSpeed from the data-parallel size, and {what} is unknown: "
            "the batch arithmetic is not checked.",
            "pass --gpus and --pp, or validate the plan directory with its plan.json",
        )

    def batch_fix(self, dp: int) -> str:
        mb = self.cfg.get("train_micro_batch_size_per_gpu")
        gas = self.cfg.get("gradient_accumulation_steps")
        if _num(mb) and _num(gas) and mb > 0 and gas > 0:
            return f"set train_batch_size to {mb} x {gas} x {dp} = {mb * gas * dp}"
        return f"make train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x {dp}"

    # pipeline schedule ------------------------------------------------------
    def schedule(self, gas: int | None) -> None:
        pp = self.ctx.pp
        if pp is None or pp <= 1 or gas is None or not isinstance(gas, int):
            return
        from planner.engines import schedule_rules

        line = ("gradient_accumulation_steps",) if "gradient_accumulation_steps" in self.cfg else ("train_batch_size",)
        problems = schedule_rules("deepspeed", "1f1b", pp, gas, 1)
        if problems:
            self.add(
                "DS011", line,
                f"gradient_accumulation_steps = {gas} micro-batches per step for {pp} pipeline stages [{self.ctx.pp_source}]: " + "; ".join(problems) + ".",
                f"use at least {pp} micro-batches (gradient_accumulation_steps >= {pp}), ideally several times more",
            )
            return
        frac = bubble_1f1b(pp, gas)
        if frac > BUBBLE_WARNING and self.ctx.planned != (pp, gas):
            self.add(
                "DS012", line,
                f"with {pp} stages and {gas} micro-batches the 1F1B pipeline idles (p - 1) / (m + p - 1) = {frac:.0%} of each step "
                f"(warning above {BUBBLE_WARNING:.0%}).",
                f"raise gradient_accumulation_steps (e.g. {4 * pp} gives {bubble_1f1b(pp, 4 * pp):.0%}) with a smaller micro-batch, or use fewer stages",
            )

    # activation checkpointing ----------------------------------------------------
    def checkpointing(self) -> None:
        if "activation_checkpointing" not in self.cfg or self.ctx.applies_checkpointing:
            return
        seen = f"none of {', '.join(self.ctx.scripts)} does" if self.ctx.scripts else "no training script beside it does"
        self.add(
            "DS008", ("activation_checkpointing",),
            "the activation_checkpointing section only takes effect if the training script calls "
            f"deepspeed.checkpointing.configure(..., deepspeed_config=...) (and checkpoints with deepspeed.checkpointing.checkpoint); {seen}.",
            "call deepspeed.checkpointing.configure in the script, or use pipeline.activation_checkpoint_interval with PipelineModule, or remove the section",
        )


def check_ds_config(text: str, ctx: DSContext) -> DSConfig:
    """Every DeepSpeed rule ``text`` (a ds_config.json) breaks in ``ctx``; findings sorted by line."""
    result = DSConfig()
    try:
        doc = parse_json(text)
    except JsonError as e:
        result.findings.append(Finding("DS014", "error", ctx.file, e.line, f"{e}; DeepSpeed cannot load it.", "fix the JSON syntax"))
        return result
    if not isinstance(doc.value, dict):
        result.findings.append(Finding("DS014", "error", ctx.file, 1, "the file is JSON but not an object; a DeepSpeed config is a JSON object.", "write the config as {...}"))
        return result
    c = _Checker(doc, ctx, known_keys())
    if doc.duplicates:  # DeepSpeed's loader raises before reading anything: nothing else applies
        c.keys()
        result.findings = c.out
        return result
    result.doc = doc
    cfg = doc.value
    result.has_pipeline_section = isinstance(cfg.get("pipeline"), dict)
    pipelined = (ctx.pp > 1) if ctx.pp is not None else (True if result.has_pipeline_section else None)
    c.keys()
    c.optimizer_type()
    result.precision = c.precision()
    result.zero = c.zero(pipelined)
    c.batch(result)
    c.schedule(result.grad_acc)
    c.checkpointing()
    pipe = cfg.get("pipeline") if isinstance(cfg.get("pipeline"), dict) else {}
    interval = pipe.get("activation_checkpoint_interval", 0)
    result.checkpoint_interval = interval if isinstance(interval, int) and not isinstance(interval, bool) else None
    result.findings = sorted(c.out, key=lambda f: (f.line or 0, f.rule, f.message))
    return result


def looks_like_ds_config(value: Any) -> bool:
    """A JSON object with at least one of DeepSpeed's characteristic top-level keys."""
    keys = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization", "pipeline", "fp16", "bf16", "optimizer", "steps_per_print"}
    return isinstance(value, dict) and "schema_version" not in value and bool(keys & set(value))


def main(argv: list[str] | None = None) -> int:
    """``python -m planner.check.deepspeed_rules [--write]``: print (or write) the key table from the installed DeepSpeed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    text = format_table(extract_key_table())
    if "--write" in argv:
        path = table_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        sys.stdout.write(f"wrote {path}\n")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
