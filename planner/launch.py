"""Launch scripts shared by the engines: torchrun, SLURM, the deepspeed launcher and its hostfile.

Every value interpolated into shell goes through ``shq`` (shlex.quote) in the
templates; values that cannot be quoted where they appear (an ``#SBATCH``
directive is not parsed by the shell) are reduced to a safe alphabet here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from planner.model_ref import ref_stem, relative_ref
from planner.solve.plan import Plan
from planner.templating import one_line, render_template


def cluster_shape(plan: Plan) -> tuple[int, int]:
    """(nodes, processes per node) of the plan's cluster (heterogeneous groups: the largest node size)."""
    groups = plan.cluster.get("groups", [])
    nodes = sum(int(g["nodes"]) for g in groups) or 1
    per_node = max((int(g["gpus_per_node"]) for g in groups), default=1)
    world = plan.layout.world
    if nodes * per_node != world:  # fewer GPUs than whole nodes, e.g. 2xA100
        per_node = world // nodes if world % nodes == 0 else world
        nodes = world // per_node
    return nodes, per_node


def model_path_for(plan: Plan, out_dir: Path | None) -> str:
    """The model file's path as the scripts see it: relative to the plan directory when both are known."""
    model = str(plan.settings.model.model_file)
    if out_dir is None:
        return model
    return relative_ref(model, out_dir)


def job_name(plan: Plan) -> str:
    stem = ref_stem(str(plan.settings.model.model_file or "train"))
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{stem}-{plan.layout.engine}")[:64] or "planner"


def torchrun_script(plan: Plan, command: str, script: str, args: Sequence[str], env: Sequence[tuple[str, str]] = ()) -> str:
    nodes, nprocs = cluster_shape(plan)
    return render_template("launch/torchrun.sh.j2", command=one_line(command), nodes=nodes, nprocs=nprocs, script=script, args=list(args), env=list(env))


def slurm_script(plan: Plan, command: str) -> str:
    nodes, nprocs = cluster_shape(plan)
    return render_template("launch/slurm.sh.j2", command=one_line(command), nodes=nodes, nprocs=nprocs, job_name=job_name(plan))


def deepspeed_script(plan: Plan, command: str, script: str, args: Sequence[str], env: Sequence[tuple[str, str]] = ()) -> str:
    nodes, nprocs = cluster_shape(plan)
    return render_template("launch/deepspeed.sh.j2", command=one_line(command), nodes=nodes, nprocs=nprocs, script=script, args=list(args), env=list(env))


def hostfile(plan: Plan, command: str) -> str:
    nodes, nprocs = cluster_shape(plan)
    return render_template("launch/hostfile.j2", command=one_line(command), hosts=[f"worker-{i}" for i in range(nodes)], nprocs=nprocs)
