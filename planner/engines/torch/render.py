"""Render a plan for torch.distributed.pipelining: train_torch.py, launch scripts, README.md.

The training script is a readable outline (its shared code is
:mod:`planner.engines.torch.runner`); it reads plan.json at start-up and refuses one
that differs from the plan it was rendered for (:func:`planned_layout`).
"""

from __future__ import annotations

from pathlib import Path

from planner.errors import UsageError
from planner.launch import cluster_shape, model_path_for, slurm_script, torchrun_script
from planner.report import trained_loss_text
from planner.runners.contract import planned_layout
from planner.solve.plan import Plan
from planner.solve.schedules import SCHEDULE_INFO
from planner.templating import one_line, render_template

SCRIPT = "train_torch.py"


def check_renderable(plan: Plan) -> str:
    """The torch schedule class for ``plan``, or a UsageError saying why torch cannot run it."""
    lay = plan.layout
    if lay.engine != "torch":
        raise UsageError(f"render_torch got a plan for engine {lay.engine!r}.", "Plan with --engine torch.")
    info = SCHEDULE_INFO.get(lay.schedule)
    if info is None or info.torch_class is None:
        raise UsageError(
            f"torch.distributed.pipelining does not run schedule {lay.schedule!r}.", "Pick one with --schedule: gpipe, 1f1b, interleaved, zb-h1, zbv."
        )
    if lay.tp != 1:
        raise UsageError(f"the torch engine runs without tensor parallelism; the plan has tp={lay.tp}.", "Plan with --tp 1 or use --engine megatron.")
    if len(plan.stages) != lay.pp * lay.vp:
        raise UsageError(f"plan.json has {len(plan.stages)} stages for pp={lay.pp} x vp={lay.vp}.")
    return info.torch_class


def _stage_lines(plan: Plan) -> list[str]:
    return [
        one_line(f"{s.index}: rank {s.rank}, pieces [{s.pieces[0]}, {s.pieces[1]}) {s.layers[0]} .. {s.layers[1]}, {s.params:,} params") for s in plan.stages
    ]


def _precision_note(plan: Plan) -> str:
    dtype = plan.settings.model.dtype
    if dtype in ("bf16", "fp16"):
        return f"{dtype} autocast over fp32 weights on GPU (--precision auto), fp32 on CPU"
    return "fp32"


def _recompute_note(plan: Plan) -> str:
    return {
        "full": "full: torch.utils.checkpoint around every piece of every stage",
        "selective": "selective was planned; torch has no generic equivalent, so the script runs without recomputation",
    }.get(plan.layout.recompute, "none")


def render(plan: Plan, command: str, out_dir: Path | None = None) -> dict[str, str]:
    """The torch engine's files of the plan directory as {relative path: text} (deterministic)."""
    torch_class = check_renderable(plan)
    lay = plan.layout
    model_path = model_path_for(plan, out_dir)
    nodes, nprocs = cluster_shape(plan)
    ctx = dict(
        command=one_line(command),
        layout_short=one_line(lay.short()),
        schedule=lay.schedule,
        torch_class=torch_class,
        global_batch=lay.global_batch,
        dp=lay.dp,
        pp=lay.pp,
        vp=lay.vp,
        num_microbatches=lay.num_microbatches,
        micro_batch=lay.micro_batch,
        precision_note=_precision_note(plan),
        recompute_note=_recompute_note(plan),
        stage_lines=_stage_lines(plan),
        model_path=model_path,
        trained_loss=one_line(trained_loss_text(plan)),
        planned=list(planned_layout(plan.to_dict()).items()),
        nodes=nodes,
        nprocs=nprocs,
        placement=SCHEDULE_INFO[lay.schedule].placement,
        split_backward=SCHEDULE_INFO[lay.schedule].split_backward,
        tied=[one_line(f"{t['name']} (pieces {', '.join(map(str, t['layers']))})") for t in plan.model.get("tied", [])],
        dtype=plan.settings.model.dtype,
        recompute=lay.recompute,
    )
    return {
        SCRIPT: render_template("torch/train_torch.py.j2", **ctx),
        "launch_torchrun.sh": torchrun_script(plan, command, SCRIPT, ["--plan", "plan.json", "--model", model_path]),
        "launch_slurm.sh": slurm_script(plan, command),
        "README.md": render_template("torch/README.md.j2", **ctx),
    }
