"""What ``planner validate`` checks of Megatron-LM's files: a launch script or an args file, recognised by its flags;
its flags checked by Megatron-LM's argument rules (planner.engines.megatron.architecture, MEG*), against plan.json
(PLAN002), and its memory per GPU re-estimated (MEM*). A launch script the planner rendered, unchanged, is run under
bash with stub launchers (in a sandbox where the platform has one); any other is read statically unless
``--run-scripts`` (planner.check.validate.rendered_unchanged, SCRIPT001)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from planner.check.validate import _costs, _cp_text, _Ctx, _memory, _Run, display, rendered_unchanged, report_script_reading
from planner.engines.base import repeated_layers
from planner.engines.megatron.architecture import RULES
from planner.errors import PlannerError
from planner.findings import from_megatron
from planner.solve.plan import Layout

#: the kinds of file this wing recognises (planner.check.validate.classify), and what they are
FILE_KINDS = ("megatron-script", "megatron-args")
FILE_WHAT = "Megatron-LM launch script (pretrain_gpt.sh)"
#: whether :func:`check` re-estimates the memory of what the file runs (else validate estimates plan.json's layout)
CHECKS_MEMORY = True
__all__ = ["CHECKS_MEMORY", "FILE_KINDS", "FILE_WHAT", "RULES", "check", "classify"]

_SCRIPT_SUFFIXES = {"", ".sh", ".bash", ".args", ".txt", ".cfg", ".conf"}
_MEGATRON_MARK = re.compile(
    r"pretrain_gpt\.py|--num-layers\b|--tensor-model-parallel-size\b|--pipeline-model-parallel-size\b|--num-attention-heads\b|--global-batch-size\b"
)
_LAUNCHER = re.compile(r"^\s*(?:exec\s+)?(?:torchrun|python3?|srun|deepspeed|mpirun)\b|^\s*export\s", re.M)


def classify(path: Path, text: str) -> str | None:
    """'megatron-script' (a launch script) or 'megatron-args' (an args file) for a file of Megatron-LM's flags."""
    suffix = path.suffix.lower()
    stripped = text.lstrip()
    if (suffix in _SCRIPT_SUFFIXES or stripped.startswith("#!")) and _MEGATRON_MARK.search(text):
        if stripped.startswith("#!") or suffix in (".sh", ".bash") or _LAUNCHER.search(text):
            return "megatron-script"
        return "megatron-args"
    return None


def check(run: _Run, ctx: _Ctx, path: Path, kind: str) -> None:
    _check_megatron(run, ctx, path, kind)


def _check_megatron(run: _Run, ctx: _Ctx, path: Path, kind: str) -> None:
    """A launch script is run under bash with stub launchers (planner.engines.megatron.script); an args file is read as words."""
    from planner.engines.megatron.architecture import check_megatron_args
    from planner.engines.megatron.script import parse_megatron_args

    rel = display(path)
    text = path.read_text()
    execute = kind == "megatron-script" and (rendered_unchanged(path) or run.opts.run_scripts)
    args = parse_megatron_args(text, "script" if kind == "megatron-script" else "args", path=path, execute=execute)
    if kind == "megatron-script":
        report_script_reading(run, path, execute, args.how)
    world = ctx.world if ctx.world is not None else args.world_size
    for f in check_megatron_args(args, world):
        run.findings.append(from_megatron(f, rel))
    if ctx.plan is not None:
        _compare_megatron_plan(run, rel, args, ctx.plan)
    _memory_megatron(run, ctx, rel, args, world)


def _megatron_recompute(args) -> str:
    gran = args.value("--recompute-granularity")
    if args.has("--recompute-activations") or gran == "selective":
        return "selective"
    return "full" if gran == "full" else "none"


def _megatron_recompute_modules(args) -> tuple[str, ...]:
    """``--recompute-modules`` as given (() when absent: Megatron's default, core_attn), for selective recomputation."""
    f = args.get("--recompute-modules")
    return tuple(f.values) if f is not None and _megatron_recompute(args) == "selective" else ()


def _compare_megatron_plan(run: _Run, rel: str, args, plan) -> None:
    from planner.engines.megatron.architecture import stage_layers

    lay = plan.layout
    first = args.launch_line or 1

    def differ(flag: str | None, message: str) -> None:
        run.add(
            "PLAN002",
            rel,
            (args.line(flag) if flag else None) or first,
            message + " The script no longer is the plan.",
            "re-run `planner plan` to regenerate both, or put back the planned value",
        )

    for flag, want, name in (
        ("--tensor-model-parallel-size", lay.tp, "tp"),
        ("--pipeline-model-parallel-size", lay.pp, "pp"),
        ("--micro-batch-size", lay.micro_batch, "micro_batch"),
        ("--global-batch-size", lay.global_batch, "global_batch"),
    ):
        have = args.int(flag, 1 if name in ("tp", "pp") else None)
        if have is not None and have != want:
            differ(flag, f"{flag} is {have} but plan.json has layout.{name} = {want}.")
    if args.world_size is not None and args.world_size != lay.world:
        differ(None, f"torchrun starts {args.world_size} processes but plan.json places pp {lay.pp} x tp {lay.tp}{_cp_text(lay)} x dp {lay.dp} = {lay.world}.")
    rc = _megatron_recompute(args)
    if rc != lay.recompute:
        differ(
            "--recompute-granularity" if args.has("--recompute-granularity") else None,
            f"the flags recompute {rc!r} but plan.json has layout.recompute = {lay.recompute!r}.",
        )
    elif rc == "selective" and frozenset(_megatron_recompute_modules(args) or ("core_attn",)) != lay.modules_recomputed:
        differ(
            "--recompute-modules" if args.has("--recompute-modules") else "--recompute-granularity",
            f"the flags recompute {' '.join(_megatron_recompute_modules(args)) or 'core_attn (the default)'} but plan.json has"
            f" layout.recompute_modules = {list(lay.recompute_modules)}.",
        )
    dist = args.has("--use-distributed-optimizer")
    if dist != (lay.zero >= 1):
        differ("--use-distributed-optimizer", f"the distributed optimizer is {'on' if dist else 'off'} but plan.json has layout.zero = {lay.zero}.")
    sp = args.has("--sequence-parallel") and (args.int("--tensor-model-parallel-size", 1) or 1) > 1
    if sp != bool(lay.sequence_parallel):
        differ("--sequence-parallel", f"sequence parallelism is {'on' if sp else 'off'} but plan.json has layout.sequence_parallel = {lay.sequence_parallel}.")
    built = stage_layers(args)
    try:
        from planner.engines.megatron.render import planned_stage_layers

        want = planned_stage_layers(plan)
    except PlannerError:
        want = None
    if built is not None and want is not None and built != want:
        flag = next(
            (
                f
                for f in (
                    "--pipeline-model-parallel-layout",
                    "--decoder-first-pipeline-num-layers",
                    "--decoder-last-pipeline-num-layers",
                    "--num-virtual-stages-per-pipeline-rank",
                    "--num-layers",
                )
                if args.has(f)
            ),
            None,
        )
        differ(flag, f"the flags build {built} decoder layers per stage but plan.json splits them {want}.")


def _memory_megatron(run: _Run, ctx: _Ctx, rel: str, args, world: int | None) -> None:
    from planner.engines.megatron.architecture import stage_layers
    from planner.solve.schedules import normalised_group

    line = args.launch_line or 1
    if ctx.cluster is None:
        run.add("MEM003", rel, line, "memory not checked: no hardware known (no --gpus, no plan.json beside the script).", "pass --gpus SPEC")
        return
    tp, pp, cp = args.int("--tensor-model-parallel-size", 1), args.int("--pipeline-model-parallel-size", 1), args.int("--context-parallel-size", 1)
    mb, gb = args.int("--micro-batch-size"), args.int("--global-batch-size")
    counts = stage_layers(args)
    world = ctx.world or ctx.cluster.world_size
    if (
        None in (tp, pp, cp, mb, gb)
        or counts is None
        or not tp
        or not pp
        or not cp
        or not mb
        or world % (tp * pp * cp)
        or gb % (mb * (world // (tp * pp * cp)))
    ):
        run.add(
            "MEM003",
            rel,
            line,
            "memory not checked: the parallel sizes, batch sizes or layer split are not consistent (see the MEG findings).",
            "fix the flags first",
        )
        return
    dp = world // (tp * pp * cp)
    vp = len(counts) // pp
    m = gb // (mb * dp)
    dtype = "bf16" if args.has("--bf16") else "fp16" if args.has("--fp16") else "fp32"
    group = args.int("--microbatch-group-size-per-virtual-pipeline-stage") or 0
    group = normalised_group("interleaved", pp, m, group) if vp > 1 else 0
    layout = Layout(
        "megatron",
        pp,
        tp,
        dp,
        vp,
        mb,
        m,
        gb,
        "interleaved" if vp > 1 else "1f1b",
        _megatron_recompute(args),
        1 if args.has("--use-distributed-optimizer") else 0,
        bool(args.has("--sequence-parallel") and tp > 1),
        cp=cp,
        tp_comm_overlap=args.has("--tp-comm-overlap"),
        overlap_grad_reduce=args.has("--overlap-grad-reduce"),
        overlap_param_gather=args.has("--overlap-param-gather"),
        # the inverse of planner.engines.megatron.render.feature_flags
        main_grads_dtype=args.value("--main-grads-dtype") or ("bf16" if args.has("--grad-reduce-in-bf16") else "fp32"),
        optimizer_state_dtype=args.value("--exp-avg-dtype") or "fp32",
        fp8=args.has("--fp8-format"),
        fp8_param_gather=args.has("--fp8-format") and args.has("--fp8-param-gather"),
        # expert parallelism; --expert-tensor-parallel-size unset means tp (arguments.py validate_args, core_v0.16.1)
        ep=args.int("--expert-model-parallel-size", 1) or 1,
        etp=args.int("--expert-tensor-parallel-size", tp) or tp,
        ep_comm_overlap=args.has("--overlap-moe-expert-parallel-comm"),
        recompute_modules=_megatron_recompute_modules(args),
        microbatch_group=group,
        cp_comm=(args.value("--cp-comm-type") or "p2p") if cp > 1 else "p2p",
    )
    costs = _costs(run, ctx, rel, line, dtype)
    if costs is None:
        return
    if not any(l.num_experts for l in costs.layers):  # a dense model: Megatron's expert sizes (etp defaults to tp) build nothing
        layout = replace(layout, ep=1, etp=1)
    blocks = repeated_layers([l.block for l in costs.layers])
    order = list(dict.fromkeys(b for b in blocks if b is not None))
    if len(order) != sum(counts):
        run.add(
            "MEM003",
            rel,
            line,
            f"memory not checked: the model file has {len(order)} transformer layers, the flags build {sum(counts)}.",
            "pass the model file (and --model-arg values) that the flags describe",
        )
        return
    first_piece = {b: blocks.index(b) for b in order}
    bounds, done = [0], 0
    for k in counts[:-1]:
        done += k
        bounds.append(first_piece[order[done]] if done < len(order) else costs.n)
    bounds.append(costs.n)
    _memory(run, ctx, rel, line, layout, tuple(bounds), f"the flags' layer split {counts} (megatron_args.stage_layers) mapped onto the model's pieces", costs)
