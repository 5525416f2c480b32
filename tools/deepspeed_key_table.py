"""Regenerate templates/validate/deepspeed_keys_<version>.tsv, the table of configuration keys DeepSpeed reads.

``python tools/deepspeed_key_table.py``           print the table extracted from the installed DeepSpeed
``python tools/deepspeed_key_table.py --write``   write it over the shipped file
``python tools/deepspeed_key_table.py --check``   exit 1 when the shipped file differs from a fresh extraction

`planner validate` only reads the shipped table (planner.engines.deepspeed.config_rules.known_keys); this script is the only
code that derives it, from DeepSpeed's own code (deepspeed/runtime/config.py and the modules it calls), without
hand-written key lists:

* top-level keys: ``DeepSpeedConfig`` is run on a dict that records every key it looks up (``get``, ``[]``, ``in``,
  ``.keys()``), plus the keys ``deepspeed.initialize`` tests on the config dict (deepspeed/__init__.py);
* sections: each key is probed with a sub-dict holding a marker key. When one of the pydantic config models
  (``DeepSpeedConfigModel`` subclasses: ``extra="forbid"``) receives it, the section's keys are that model's fields
  and aliases, recursively through nested models, and DeepSpeed refuses unknown keys there at start-up. Otherwise
  the keys the recording sub-dict saw are the section's keys, and DeepSpeed silently ignores others (probed
  recursively);
* ``pipeline``: ``get_pipeline_config`` merges the section over a dict of defaults (its keys are accepted), and the
  pipeline engine reads only what deepspeed/runtime/pipe/*.py subscript from ``_config.pipeline`` (the other
  defaults are accepted but never read);
* removed features: ``_REMOVED_TOP_LEVEL_CONFIG_KEYS`` / ``_REMOVED_ZERO_CONFIG_KEYS`` (DeepSpeedConfig raises
  DeepSpeedConfigError);
* ``optimizer.params`` / ``scheduler.params``: the keyword arguments of the classes ``DeepSpeedEngine`` constructs
  for each optimizer / scheduler type (it calls them with ``**params``, so an unknown key is a TypeError), plus the
  keys the engine pops first.

Needs deepspeed (and torch) installed: ``DS_BUILD_OPS=0 pip install deepspeed==<version>``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import logging
import sys
import typing
from pathlib import Path
from typing import Any

from planner.engines.deepspeed.config_rules import (
    DEEPSPEED_VERSION,
    DEPRECATED,
    FORBID,
    IGNORE,
    KWARGS,
    REMOVED,
    SECTION,
    UNREAD,
    VALUE,
    KeyInfo,
    KeyTable,
    join,
    table_path,
)

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


def format_table(table: KeyTable) -> str:
    head = [
        f"# DeepSpeed {DEEPSPEED_VERSION} configuration keys, generated from its sources by",
        "# `python tools/deepspeed_key_table.py --write`. Do not edit.",
        "# section\tkey\tkind\tnote",
    ]
    body = ["\t".join(_clean(x) for x in row) for row in table.rows()]
    return "\n".join(head + body) + "\n"


def _clean(text: str) -> str:
    return " ".join(str(text).split())


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
    with contextlib.suppress(Exception):  # probing: most markers make DeepSpeed raise after reading
        C.DeepSpeedConfig(_Recording(cfg))
    return list(hits), sub - {PROBE}


def _ast_keys_of(tree: ast.AST, names: set[str], func: str | None = None) -> set[str]:
    """String keys tested or subscripted on a variable called one of ``names`` (``"k" in config``, ``config["k"]``)."""
    out: set[str] = set()
    roots = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == func] if func else [tree]
    for root in roots:
        for node in ast.walk(root):
            if (
                isinstance(node, ast.Compare)
                and isinstance(node.left, ast.Constant)
                and isinstance(node.left.value, str)
                and any(isinstance(op, ast.In) for op in node.ops)
                and any(isinstance(c, ast.Name) and c.id in names for c in node.comparators)
            ):
                out.add(node.left.value)
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Name)
                and node.value.id in names
                and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)
            ):
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
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                target, key = node.func.value, node.args[0].value
            if target is not None and isinstance(key, str) and ast.unparse(target).endswith("_config.pipeline"):
                read.add(key)
    return defaults, read


def _engine_optimizer_keys(ds_root: Path) -> tuple[set[str], set[str]]:
    """(keys DeepSpeedEngine pops from optimizer.params before calling the optimizer class, keys it passes itself).

    Read from deepspeed/runtime/engine.py: ``optimizer_parameters.pop(KEY, ...)`` anywhere, and the dict keys that
    ``get_optimizer_configuration`` returns as extra keyword arguments for the Adam classes.
    """
    from deepspeed.runtime import engine

    def name_of(arg: ast.AST) -> str | None:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.Name) and isinstance(getattr(engine, arg.id, None), str):
            return getattr(engine, arg.id)
        return None

    tree = ast.parse((ds_root / "runtime" / "engine.py").read_text())
    popped: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "pop"
            and node.args
            and ast.unparse(node.func.value) == "optimizer_parameters"
            and name_of(node.args[0])
        ):
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
    mod, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(mod), name)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return {p.name for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}  # params[0]: the parameters / optimizer


def extract_key_table() -> KeyTable:
    """Build the key table from the installed DeepSpeed (imports deepspeed and torch)."""
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
    import deepspeed.runtime.config as C
    import torch
    from deepspeed.runtime import lr_schedules

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


def main(argv: list[str] | None = None) -> int:
    """Print, write (``--write``) or check (``--check``) the key table of the installed DeepSpeed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.getLogger("DeepSpeed").disabled = True  # DeepSpeed logs to stdout, where the table goes
    import deepspeed

    if deepspeed.__version__ != DEEPSPEED_VERSION:
        sys.stderr.write(
            f"DeepSpeed {deepspeed.__version__} is installed; the table is for {DEEPSPEED_VERSION} (DEEPSPEED_VERSION in planner/check/deepspeed_rules.py).\n"
        )
        return 2
    text = format_table(extract_key_table())
    path = table_path()
    if "--check" in argv:
        same = path.is_file() and path.read_text() == text
        sys.stdout.write(f"{path}: {'up to date' if same else 'stale: run python tools/deepspeed_key_table.py --write'}\n")
        return 0 if same else 1
    if "--write" in argv:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        sys.stdout.write(f"wrote {path}\n")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
