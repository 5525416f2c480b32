"""What ``planner validate`` checks of DeepSpeed's files: a ds_config.json, recognised by its keys, checked with
DeepSpeed's own config class and the rules of planner.engines.deepspeed.config_rules (DS*), against plan.json
(PLAN001), and its memory per GPU re-estimated with the planner's memory model (MEM*)."""

from __future__ import annotations

import re
from pathlib import Path

from planner.check.validate import _costs, _Ctx, _memory, _read, _Run, display
from planner.engines.deepspeed.config_class import partition_balanced
from planner.engines.deepspeed.config_rules import RULES, DSConfig, DSContext, check_ds_config, looks_like_ds_config
from planner.errors import UsageError
from planner.fileio import strict_json
from planner.solve.plan import Layout

#: the kinds of file this wing recognises (planner.check.validate.classify), and what they are
FILE_KINDS = ("deepspeed",)
FILE_WHAT = "DeepSpeed config (ds_config.json)"
#: whether :func:`check` re-estimates the memory of what the file runs (else validate estimates plan.json's layout)
CHECKS_MEMORY = True
__all__ = ["CHECKS_MEMORY", "FILE_KINDS", "FILE_WHAT", "RULES", "check", "classify"]

_DS_KEY = re.compile(r'"(train_batch_size|train_micro_batch_size_per_gpu|zero_optimization|gradient_accumulation_steps)"')


def classify(path: Path, text: str) -> str | None:
    """'deepspeed' for a DeepSpeed JSON config (by its keys; a broken one by the keys its text names)."""
    if path.suffix.lower() != ".json" and not text.lstrip().startswith("{"):
        return None
    try:
        value = strict_json(text)
    except (ValueError, RecursionError):
        return "deepspeed" if path.name != "plan.json" and path.suffix.lower() == ".json" and _DS_KEY.search(text) else None
    return "deepspeed" if looks_like_ds_config(value) else None


def check(run: _Run, ctx: _Ctx, path: Path, kind: str) -> None:
    _check_deepspeed(run, ctx, path)


def _scripts(directory: Path) -> tuple[tuple[str, ...], bool]:
    """Python files beside a config, and whether one calls deepspeed.checkpointing.configure."""
    names, applies = [], False
    for p in sorted(directory.glob("*.py")):
        names.append(p.name)
        text = _read(p) or ""
        if re.search(r"checkpointing\s*\.\s*configure\s*\(", text):
            applies = True
    return tuple(names), applies


def _check_deepspeed(run: _Run, ctx: _Ctx, path: Path) -> None:
    rel = display(path)
    text = path.read_text()
    plan, opts = ctx.plan, run.opts
    pp, pp_source = opts.pp, "--pp" if opts.pp else ""
    mp, planned = 1, None
    if plan is not None:
        if pp is None:
            pp, pp_source = plan.layout.pp, "plan.json"
        mp = plan.layout.tp
        planned = (plan.layout.pp, plan.layout.num_microbatches)
    world, world_source = ctx.world, (ctx.cluster_source if run.opts.gpus else "plan.json")
    if world is not None and pp is not None and world % (pp * mp):
        if plan is None or opts.pp is not None:
            raise UsageError(
                f"--pp {pp} (x model-parallel {mp}) does not divide the {world} GPUs of {world_source}.", "Pass a --pp that divides the GPU count."
            )
    scripts, applies = _scripts(path.parent)
    dsctx = DSContext(
        file=rel,
        world_size=world,
        world_source=world_source,
        pp=pp,
        pp_source=pp_source,
        mp=mp,
        scripts=scripts,
        applies_checkpointing=applies,
        planned=planned,
    )
    cfg = check_ds_config(text, dsctx)
    run.findings.extend(cfg.findings)
    if cfg.doc is None:
        return
    if plan is not None:
        _compare_ds_plan(run, rel, cfg, plan)
    _memory_deepspeed(run, ctx, rel, cfg, pp, pp_source, mp)


def _compare_ds_plan(run: _Run, rel: str, cfg: DSConfig, plan) -> None:
    lay, doc = plan.layout, cfg.doc
    raw = doc.value
    checks = [
        (("train_batch_size",), raw.get("train_batch_size"), lay.global_batch, "global_batch"),
        (("train_micro_batch_size_per_gpu",), raw.get("train_micro_batch_size_per_gpu"), lay.micro_batch, "micro_batch"),
        (("gradient_accumulation_steps",), raw.get("gradient_accumulation_steps"), lay.num_microbatches, "num_microbatches"),
        (("zero_optimization", "stage"), cfg.zero, lay.zero, "zero"),
        (("pipeline", "activation_checkpoint_interval"), cfg.checkpoint_interval, 1 if lay.recompute == "full" else 0, "recompute"),
        (("bf16", "enabled"), cfg.precision, plan.settings.model.dtype or plan.model.get("dtype"), "dtype"),
    ]
    for path, have, want, name in checks:
        if have is None or want is None or have == want:
            continue
        where = f"layout.{name}" if name != "dtype" else "inputs.dtype"
        shown = f"{want} (recompute={lay.recompute})" if name == "recompute" else want
        run.add(
            "PLAN001",
            rel,
            doc.line(*path) or 1,
            f"{'.'.join(path) if name != 'dtype' else 'precision'} is {have} here but plan.json has {where} = {shown}: the config no longer is the plan.",
            "re-run `planner plan` to regenerate both, or put back the planned value",
        )


def _memory_deepspeed(run: _Run, ctx: _Ctx, rel: str, cfg: DSConfig, pp: int | None, pp_source: str, mp: int) -> None:

    line = (cfg.doc.line("train_micro_batch_size_per_gpu") or cfg.doc.line("train_batch_size") or 1) if cfg.doc else 1
    if ctx.cluster is None:
        run.add("MEM003", rel, line, "memory not checked: no hardware known (no --gpus, no plan.json beside the config).", "pass --gpus SPEC")
        return
    if pp is None:
        run.add(
            "MEM003",
            rel,
            line,
            "memory not checked: the pipeline depth is unknown (it is set in the training script).",
            "pass --pp N, or keep plan.json beside the config",
        )
        return
    if cfg.micro_batch is None or cfg.grad_acc is None or cfg.zero is None:
        run.add(
            "MEM003",
            rel,
            line,
            "memory not checked: the batch sizes or the ZeRO stage could not be determined (see the other findings).",
            "fix the batch values",
        )
        return
    world = ctx.world
    dp = world // (pp * mp)
    plan = ctx.plan
    recompute = "full" if (cfg.checkpoint_interval or 0) > 0 else "none"
    layout = Layout("deepspeed", pp, mp, dp, 1, int(cfg.micro_batch), int(cfg.grad_acc), int(cfg.train_batch), "1f1b", recompute, int(cfg.zero), False)
    dtype = cfg.precision or (plan.settings.model.dtype if plan is not None else None) or "bf16"
    costs = _costs(run, ctx, rel, line, dtype)
    if costs is None:
        return
    if plan is not None and len(plan.stages) == pp and len(plan.model.get("pieces") or []) == costs.n:
        bounds = tuple([s.pieces[0] for s in sorted(plan.stages, key=lambda s: s.index)] + [costs.n])
        split = "the stage split of plan.json"
    else:
        bounds = tuple(partition_balanced([l.params for l in costs.layers], pp))
        split = "DeepSpeed's default partition_method='parameters' over the model's pieces (no plan.json split)"
    _memory(run, ctx, rel, line, layout, bounds, split, costs)
