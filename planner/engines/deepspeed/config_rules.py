"""DeepSpeed config rules for `planner validate`.

Checks a ds_config.json as DeepSpeed 0.19.8 reads it, with the line of every key:

* DeepSpeed's own verdict: where deepspeed is importable, ``DeepSpeedConfig`` is run on the config for the planned
  data-parallel size (planner.engines.deepspeed.config_class) and every refusal is a finding (DS016) with its message;
  without deepspeed, type and range checks of what it would refuse;
* batch arithmetic, as ``DeepSpeedConfig`` fills and checks it (``train_batch_size == micro * gas * world_size``,
  all > 0), where under pipeline parallelism the world size DeepSpeedConfig sees is the data-parallel size,
  world / (pp x model-parallel) (deepspeed/runtime/config.py; /work/shared/reference/engines.md); when that size is
  unknown, what holds for every possible one;
* ZeRO stage >= 2 with a pipeline, which ``PipelineEngine.__init__`` refuses only at
  start-up (planner.engines.deepspeed.rules); fp16 with bf16;
* every key at every level against the table of keys DeepSpeed reads
  (:func:`known_keys`), with the closest known key suggested; removed,
  deprecated and accepted-but-unread keys; optimizer/scheduler ``params`` against
  the keyword arguments of the class DeepSpeed builds;
* an ``activation_checkpointing`` section no script applies;
* fewer micro-batches than pipeline stages (Engine.schedule_problems) and a
  large 1F1B bubble, (p - 1) / (m + p - 1) > :data:`BUBBLE_WARNING`.

The key table ships as data (``templates/validate/deepspeed_keys_<version>.tsv``), so the key checks need no
DeepSpeed install; ``tools/deepspeed_key_table.py`` derives it from DeepSpeed's own code (and tests compare the
shipped file with a fresh extraction). This module only reads it.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from planner.engines.deepspeed import config_class as deepspeed_engine
from planner.engines.deepspeed.config_class import BatchError
from planner.engines.deepspeed.rules import ENGINE as DEEPSPEED
from planner.errors import close_matches
from planner.findings import Finding
from planner.json_doc import JsonDoc, JsonError, parse_json

# --------------------------------------------------------------------------- known keys (data)

DEEPSPEED_VERSION = "0.19.8"
TABLE_NAME = f"deepspeed_keys_{DEEPSPEED_VERSION}.tsv"

#: kinds of rows in the table
VALUE, SECTION, UNREAD, DEPRECATED, REMOVED = "value", "section", "unread", "deprecated", "removed"
#: section policies: DeepSpeed refuses unknown keys (pydantic extra="forbid"), silently ignores them,
#: or passes them as keyword arguments to a constructor (TypeError at deepspeed.initialize)
FORBID, IGNORE, KWARGS = "forbid", "ignore", "kwargs"


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
    "DS016": ("error", "DeepSpeedConfig refuses the config (a value of the wrong type or out of range)"),
}
#: refusals our own rules already explain; the config is repaired at their keys before DeepSpeedConfig runs
_EXPLAINED = ("DS003", "DS004", "DS010")
#: the most DeepSpeedConfig refusals reported per config (each one found by removing the previous culprit)
MAX_REFUSALS = 20


def bubble_1f1b(p: int, m: int) -> float:
    """Idle fraction of a 1F1B (or GPipe) pipeline with equal stages: (p - 1) / (m + p - 1)."""
    return (p - 1) / (m + p - 1)


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

    @property
    def data_parallel(self) -> int | None:
        """The world size DeepSpeedConfig sees: world / (pp x model-parallel), when known and whole."""
        if self.world_size is None or self.pp is None or self.pp < 1 or self.mp < 1 or self.world_size % (self.pp * self.mp):
            return None
        return self.world_size // (self.pp * self.mp)


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


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def _has(cfg: dict[str, Any], path: tuple[Any, ...]) -> bool:
    node: Any = cfg
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _delete(cfg: dict[str, Any], path: tuple[Any, ...]) -> bool:
    """Remove ``path`` from nested dicts ``cfg``; whether it was there."""
    node: Any = cfg
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict) and path[-1] in node:
        del node[path[-1]]
        return True
    return False


class _Checker:
    def __init__(self, doc: JsonDoc, ctx: DSContext, table: KeyTable):
        self.doc, self.ctx, self.table = doc, ctx, table
        self.cfg: dict[str, Any] = doc.value
        self.out: list[Finding] = []
        self.paths: list[tuple[str, tuple[Any, ...]]] = []  # (rule, key path) of every finding with a path

    def add(self, rule: str, path: tuple[Any, ...] | None, message: str, fix: str) -> None:
        line = self.doc.line(*path) if path else None
        if path:
            self.paths.append((rule, tuple(path)))
        self.out.append(Finding(rule, RULES[rule][0], self.ctx.file, line or 1, message, fix))  # type: ignore[arg-type]

    # DeepSpeed's own verdict ------------------------------------------------
    def engine(self, data_parallel: int | None) -> None:
        """DS016 for each refusal of DeepSpeedConfig (or, without deepspeed, of the type and range checks)."""
        if not deepspeed_engine.available():
            sections = tuple(k for k, i in self.table.sections.get("", {}).items() if i.kind == SECTION)
            for path, message in deepspeed_engine.type_problems(self.cfg, sections):
                if self._explained(path):
                    continue
                self.add(
                    "DS016",
                    path,
                    f"{message} (type and range checks of DeepSpeed {deepspeed_engine.VENDORED_VERSION}'s DeepSpeedConfig; "
                    "deepspeed is not installed here, so DeepSpeedConfig itself was not run).",
                    "give it a value of the type and range DeepSpeed documents",
                )
            return
        dp = data_parallel or 1
        cfg = self._repaired(dp)
        seen: set[str] = set()
        head = f"DeepSpeedConfig (DeepSpeed {deepspeed_engine.version()}, {dp} data-parallel rank{'s' if dp != 1 else ''}) refuses this config"
        for _ in range(MAX_REFUSALS):
            err = deepspeed_engine.refusal(cfg, dp)
            if err is None:
                return
            text = deepspeed_engine.describe(err)
            if text in seen:
                return
            seen.add(text)
            key = self._culprit(cfg, text, dp)
            if key is None:
                self.add("DS016", None, f"{head}: {text}", "fix the config so that DeepSpeedConfig accepts it")
                return
            title = getattr(err, "title", type(err).__name__)
            fields = [((key,) + loc, f"{title}: {msg}") for loc, msg in deepspeed_engine.field_errors(err) if loc and _has(cfg, (key,) + loc)]
            for path, msg in fields or [((key,), text)]:
                self.add("DS016", path, f"{head} at {_dotted(path)}: {msg}", f"give {_dotted(path)} a value of the type and range DeepSpeed documents")
            for path, _ in fields or [((key,), text)]:
                _delete(cfg, path)

    def _explained(self, path: tuple[Any, ...]) -> bool:
        return any(rule in _EXPLAINED and path[: len(p)] == p for rule, p in self.paths)

    def _repaired(self, dp: int) -> dict[str, Any]:
        """The config with what other rules already report taken out: consistent batch values for ``dp`` ranks (DS001
        checks the written ones) and the keys of DS003/DS004/DS010 findings removed."""
        cfg = copy.deepcopy(self.cfg)
        for key in deepspeed_engine.BATCH_KEYS:
            cfg.pop(key, None)
        cfg.update(train_batch_size=dp, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
        for rule, path in self.paths:
            if rule in _EXPLAINED:
                _delete(cfg, path)
        return cfg

    def _culprit(self, cfg: dict[str, Any], text: str, dp: int) -> str | None:
        """The top-level key DeepSpeed refuses: the one whose removal changes its verdict."""
        for key in [k for k in cfg if k not in deepspeed_engine.BATCH_KEYS]:
            other = deepspeed_engine.refusal({k: v for k, v in cfg.items() if k != key}, dp)
            if other is None or deepspeed_engine.describe(other) != text:
                return key
        return None

    # keys -------------------------------------------------------------------
    def keys(self) -> None:
        for path, line, first in self.doc.duplicates:
            self.out.append(
                Finding(
                    "DS014",
                    "error",
                    self.ctx.file,
                    line,
                    f"{_dotted(path)} is given twice (first on line {first}); DeepSpeed's loader refuses duplicate keys (dict_raise_error_on_duplicate_keys).",
                    "keep one of them",
                )
            )
        if not self.table.sections:
            return
        self.walk(self.cfg, (), "")

    def walk(self, obj: dict[str, Any], path: tuple[Any, ...], section: str) -> None:
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
                    "DS009",
                    here,
                    f"{_dotted(here)} is deprecated in DeepSpeed {DEEPSPEED_VERSION}"
                    + (f"; it is replaced by {info.note!r}" if info.note else "")
                    + " (DeepSpeed logs a warning).",
                    f"use {info.note!r} instead" if info.note else "remove it",
                )
            elif info.kind == UNREAD:
                self.unread(here, key)
            if here == ("optimizer", "params") or here == ("scheduler", "params"):
                self.params(here, val)
            elif info.kind == SECTION and isinstance(val, dict):
                self.walk(val, here, f"{section}.{key}" if section else key)

    def unknown(self, here: tuple[Any, ...], key: str, section: str, policy: str, known: dict[str, Any]) -> None:
        candidates = [k for k, i in known.items() if i.kind not in (REMOVED,)]
        where = f"the {section} section" if section else "the top level"
        if policy == FORBID:
            hits = close_matches(key, candidates)
            self.add(
                "DS004",
                here,
                f"{_dotted(here)} is not a key of {where} in DeepSpeed {DEEPSPEED_VERSION}; DeepSpeed refuses the config at start-up "
                "(pydantic: 'Extra inputs are not permitted').",
                f"did you mean {' or '.join(repr(h) for h in hits)}?" if hits else f"remove it; known keys: {', '.join(sorted(candidates)[:12])}",
            )
            return
        module_args = self.table.sections.get("pipeline:module_args", {})
        if section == "pipeline" and key in module_args:
            self.add(
                "DS007",
                here,
                f"pipeline.{key} is an argument of deepspeed.pipe.PipelineModule, not a config key: DeepSpeed never reads it from the config.",
                f"pass {key}=... to PipelineModule(...) in the training script, and remove it here",
            )
            return
        best = difflib.get_close_matches(key, candidates, n=1, cutoff=MISSPELLING_RATIO)
        if best:
            self.add(
                "DS005",
                here,
                f"{_dotted(here)} is not a key of {where} in DeepSpeed {DEEPSPEED_VERSION}; DeepSpeed silently ignores it, so the setting has no effect. "
                f"Did you mean {best[0]!r}?",
                f"rename it to {best[0]!r}",
            )
            return
        hits = close_matches(key, candidates)
        self.add(
            "DS006",
            here,
            f"{_dotted(here)} is not a key of {where} in DeepSpeed {DEEPSPEED_VERSION}; DeepSpeed silently ignores it."
            + (f" Closest known: {', '.join(repr(h) for h in hits)}." if hits else ""),
            "remove it (or keep it if your own code reads it)",
        )

    def unread(self, here: tuple[Any, ...], key: str) -> None:
        module_args = self.table.sections.get("pipeline:module_args", {})
        arg = difflib.get_close_matches(key, list(module_args), n=1, cutoff=0.6) if here[0] == "pipeline" else []
        self.add(
            "DS007",
            here,
            f"{_dotted(here)} is accepted but never read by DeepSpeed {DEEPSPEED_VERSION}'s pipeline engine: it has no effect."
            + (f" The PipelineModule argument {arg[0]!r} is what sets it." if arg else ""),
            (f"pass {arg[0]}=... to PipelineModule(...) and remove it here" if arg else "remove it"),
        )

    def params(self, here: tuple[Any, ...], val: Any) -> None:
        owner = self.cfg.get(here[0])
        if not isinstance(val, dict) or not isinstance(owner, dict):
            return
        kind = owner.get("type")
        if not isinstance(kind, str):
            return
        if here[0] == "optimizer" and kind.lower() in self.table.sections.get("optimizer:types", {}):
            kind = kind.lower()
        if (
            self.table.sections.get(f"{here[0]}.params:{kind}") is None
            and here[0] == "optimizer"
            and kind not in self.table.sections.get("optimizer:types", {})
        ):
            return  # an unknown type is reported once, by optimizer_type()
        if here[0] == "optimizer" and "max_grad_norm" in val:
            self.add(
                "DS015",
                here + ("max_grad_norm",),
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
                "DS015",
                here + (key,),
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
            "DS015",
            ("optimizer", "type"),
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
            self.add(
                "DS003",
                (bkey, "enabled"),
                "fp16 and bf16 are both enabled; DeepSpeedConfig asserts 'bfloat16 and fp16 modes cannot be simultaneously enabled'.",
                "enable one of them",
            )
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
            known_pp = self.ctx.pp is not None and self.ctx.pp > 1
            because = f"pipeline parallelism (pp = {self.ctx.pp}, from {self.ctx.pp_source})" if known_pp else "a pipeline section (pipeline parallelism)"
            reason = DEEPSPEED.zero_problems(stage, self.ctx.pp if known_pp else 2)
            self.add(
                "DS002",
                ("zero_optimization", "stage"),
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
                "DS013",
                (line_key,),
                "batch values are 'auto': Hugging Face's Trainer fills them before DeepSpeed sees the config, so they are not checked here.",
                "give numbers to check the batch arithmetic",
            )
            return
        bad = [n for n, v in zip(names, vals) if v is not None and not _num(v)]
        if bad:
            self.add(
                "DS001", (bad[0],), f"{bad[0]} is {self.cfg.get(bad[0])!r}, not a number; DeepSpeed's batch arithmetic fails on it.", "write a positive integer"
            )
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
                result.train_batch, result.micro_batch, result.grad_acc = deepspeed_engine.batch_values(tbs, mb, gas, dp)
            except BatchError as e:
                self.add(
                    "DS001",
                    (line_key if tbs is None else "train_batch_size",),
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
                    "DS001",
                    ("train_batch_size",),
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
                        "DS001",
                        ("train_batch_size",),
                        f"train_batch_size {tbs} = micro {mb} x gas {gas} x {need} needs a data-parallel size of {need}, which no pipeline depth "
                        f"gives on {world} GPUs [{ctx.world_source}] (possible data-parallel sizes: {', '.join(map(str, options))}).",
                        f"make train_batch_size = {mb * gas} x the data-parallel size",
                    )
                    return
                self.add(
                    "DS013",
                    ("train_batch_size",),
                    f"the pipeline depth is unknown; the batch sizes hold only with a data-parallel size of {need} "
                    f"(pp x model-parallel = {world // need} on {world} GPUs).",
                    "pass --pp, or validate the plan directory with its plan.json",
                )
                return
            self.add(
                "DS013",
                ("train_batch_size",),
                f"the number of GPUs is unknown; the batch sizes hold only with a data-parallel size of {need}.",
                "pass --gpus (and --pp), or validate the plan directory with its plan.json",
            )
            return
        missing = [n for n, v in zip(names, vals) if v is None]
        if tbs is None and mb is None:
            self.add(
                "DS001",
                (line_key,),
                "DeepSpeedConfig fails: either train_batch_size or train_micro_batch_size_per_gpu needs to be provided.",
                "give train_batch_size and train_micro_batch_size_per_gpu",
            )
            return
        what = "the number of GPUs" if world is None else "the pipeline depth"
        self.add(
            "DS013",
            (line_key,),
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
        line = ("gradient_accumulation_steps",) if "gradient_accumulation_steps" in self.cfg else ("train_batch_size",)
        problems = DEEPSPEED.schedule_problems("1f1b", pp, gas, 1)
        if problems:
            self.add(
                "DS011",
                line,
                f"gradient_accumulation_steps = {gas} micro-batches per step for {pp} pipeline stages [{self.ctx.pp_source}]: " + "; ".join(problems) + ".",
                f"use at least {pp} micro-batches (gradient_accumulation_steps >= {pp}), ideally several times more",
            )
            return
        frac = bubble_1f1b(pp, gas)
        if frac > BUBBLE_WARNING and self.ctx.planned != (pp, gas):
            self.add(
                "DS012",
                line,
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
            "DS008",
            ("activation_checkpointing",),
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
        result.findings.append(
            Finding("DS014", "error", ctx.file, 1, "the file is JSON but not an object; a DeepSpeed config is a JSON object.", "write the config as {...}")
        )
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
    c.engine(ctx.data_parallel)
    pipe = cfg.get("pipeline") if isinstance(cfg.get("pipeline"), dict) else {}
    interval = pipe.get("activation_checkpoint_interval", 0)
    result.checkpoint_interval = interval if isinstance(interval, int) and not isinstance(interval, bool) else None
    result.findings = sorted(c.out, key=lambda f: (f.line or 0, f.rule, f.message))
    return result


def looks_like_ds_config(value: Any) -> bool:
    """A JSON object with at least one of DeepSpeed's characteristic top-level keys."""
    keys = {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "zero_optimization",
        "pipeline",
        "fp16",
        "bf16",
        "optimizer",
        "steps_per_print",
    }
    return isinstance(value, dict) and "schema_version" not in value and bool(keys & set(value))
