"""Render a plan for DeepSpeed's pipeline engine: ds_config.json, train_deepspeed.py, launchers, README.md.

ds_config.json holds only keys DeepSpeed 0.19.8 reads (checked against
deepspeed/runtime/config.py, runtime/engine.py and runtime/pipe/engine.py):

* batch: ``train_batch_size = train_micro_batch_size_per_gpu x
  gradient_accumulation_steps x data-parallel size`` (``_batch_assertion``;
  under pipeline parallelism the data-parallel size is world / pp);
* precision: ``bf16`` (``immediate_grad_update``: each micro-batch's bf16
  gradient is added to the optimizer's accumulation buffer and freed at once,
  so no second gradient copy stays alive) plus, at ZeRO stage 1,
  ``data_types.grad_accum_dtype = fp32``: ``_do_optimizer_sanity_check`` then
  picks BF16_Optimizer (fp32 master weights and Adam moments partitioned over
  the data-parallel group, fp32 gradient accumulation buffer); at ZeRO 0 the
  pipeline engine picks BF16_Optimizer with a bf16 buffer. ``fp16`` for fp16;
  neither for fp32;
* ``zero_optimization.stage`` 0 or 1 (PipelineEngine refuses 2 and 3);
* ``pipeline``: only the four keys the engine reads; ``activation_checkpoint_interval``
  1 for recompute=full (the engine copies it onto the module), with
  ``use_reentrant`` false (DeepSpeed's non-reentrant checkpoint: the first
  stage's inputs are token ids that need no gradient);
* ``gradient_clipping``, ``steps_per_print``, ``wall_clock_breakdown``.
There is no ``optimizer`` section: the script passes ``torch.optim.AdamW``
(DeepSpeed's FusedAdam would be JIT-compiled on first use).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from planner.engines.deepspeed.rules import ENGINE, precision_config
from planner.errors import UsageError
from planner.fileio import dumps_json
from planner.launch import cluster_shape, deepspeed_script, hostfile, model_path_for, slurm_script, torchrun_script
from planner.report import trained_loss_text
from planner.runners.contract import planned_layout
from planner.solve.plan import Plan
from planner.templating import one_line, render_template

SCRIPT = "train_deepspeed.py"
CONFIG = "ds_config.json"
DEEPSPEED_VERSION = "0.19.8"
GRADIENT_CLIPPING = 1.0
STEPS_PER_PRINT = 10


def check_renderable(plan: Plan) -> None:
    """Raise a UsageError unless DeepSpeed's pipeline engine can run ``plan`` as planned."""
    lay = plan.layout
    problems = []
    if lay.engine != "deepspeed":
        problems.append(f"the plan is for engine {lay.engine!r}")
    if lay.tp != 1:
        problems.append(f"DeepSpeed's pipeline engine has no tensor parallelism of its own (tp={lay.tp})")
    if lay.vp != 1:
        problems.append(f"DeepSpeed's pipeline engine has no virtual stages (vp={lay.vp})")
    if lay.schedule != "1f1b":
        problems.append(f"DeepSpeed's pipeline engine runs 1F1B only, not {lay.schedule!r}")
    problems += ENGINE.zero_problems(lay.zero, lay.pp)
    if len(plan.stages) != lay.pp:
        problems.append(f"plan.json has {len(plan.stages)} stages for pp={lay.pp}")
    if lay.micro_batch * lay.num_microbatches * lay.dp != lay.global_batch:
        problems.append(f"micro_batch {lay.micro_batch} x num_microbatches {lay.num_microbatches} x dp {lay.dp} != global_batch {lay.global_batch}")
    if problems:
        raise UsageError(f"Cannot render this plan for DeepSpeed: {'; '.join(problems)}.", "Re-plan with --engine deepspeed.")


def ds_config(plan: Plan) -> dict[str, Any]:
    """The DeepSpeed configuration for ``plan`` (a plain dict; written with sorted keys)."""
    check_renderable(plan)
    lay = plan.layout
    cfg: dict[str, Any] = {
        "train_batch_size": lay.micro_batch * lay.num_microbatches * lay.dp,
        "train_micro_batch_size_per_gpu": lay.micro_batch,
        "gradient_accumulation_steps": lay.num_microbatches,
        "zero_optimization": {"stage": lay.zero},
        "gradient_clipping": GRADIENT_CLIPPING,
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
        "pipeline": {
            "activation_checkpoint_interval": 1 if lay.recompute == "full" else 0,
            "use_reentrant": False,
            "pipe_partitioned": False,
            "grad_partitioned": False,
        },
    }
    return precision_config(cfg, plan.settings.model.dtype)


def _stage_lines(plan: Plan) -> list[str]:
    return [one_line(f"{s.index}: pieces [{s.pieces[0]}, {s.pieces[1]}) {s.layers[0]} .. {s.layers[1]}, {s.params:,} params") for s in plan.stages]


def _optimizer_note(plan: Plan) -> str:
    dtype, zero = plan.settings.model.dtype, plan.layout.zero
    if dtype == "bf16":
        acc = "fp32" if zero >= 1 else "bf16"
        return (
            f"BF16_Optimizer: bf16 weights, {acc} gradient accumulation buffer, fp32 master weights and AdamW moments partitioned over the data-parallel group"
        )
    if dtype == "fp16":
        return "ZeRO stage 1 optimizer (fp16, dynamic loss scaling)" if zero else "FP16_Optimizer (fp32 master weights, dynamic loss scaling)"
    return "ZeRO stage 1 optimizer (fp32)" if zero else "torch AdamW directly (fp32)"


def render(plan: Plan, command: str, out_dir: Path | None = None) -> dict[str, str]:
    """The DeepSpeed engine's files of the plan directory as {relative path: text} (deterministic)."""
    cfg = ds_config(plan)
    lay = plan.layout
    model_path = model_path_for(plan, out_dir)
    nodes, nprocs = cluster_shape(plan)
    ctx = dict(
        command=one_line(command),
        layout_short=one_line(lay.short()),
        pp=lay.pp,
        dp=lay.dp,
        zero=lay.zero,
        micro_batch=lay.micro_batch,
        num_microbatches=lay.num_microbatches,
        global_batch=lay.global_batch,
        recompute=lay.recompute,
        dtype=plan.settings.model.dtype,
        optimizer_note=_optimizer_note(plan),
        stage_lines=_stage_lines(plan),
        tied=[one_line(f"{t['name']} (pieces {', '.join(map(str, t['layers']))})") for t in plan.model.get("tied", [])],
        model_path=model_path,
        trained_loss=one_line(trained_loss_text(plan)),
        planned=list(planned_layout(plan.to_dict()).items()),
        nodes=nodes,
        nprocs=nprocs,
        world=lay.pp * lay.dp,
        deepspeed_version=DEEPSPEED_VERSION,
        gradient_clipping=GRADIENT_CLIPPING,
        config_name=CONFIG,
        script=SCRIPT,
    )
    args = ["--plan", "plan.json", "--model", model_path]
    files = {
        CONFIG: dumps_json(cfg),
        SCRIPT: render_template("deepspeed/train_deepspeed.py.j2", **ctx),
        "launch_deepspeed.sh": deepspeed_script(plan, command, SCRIPT, args),
        "launch_torchrun.sh": torchrun_script(plan, command, SCRIPT, args),
        "launch_slurm.sh": slurm_script(plan, command),
        "README.md": render_template("deepspeed/README.md.j2", **ctx),
    }
    if nodes > 1:
        files["hostfile"] = hostfile(plan, command)
    return files
