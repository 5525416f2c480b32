"""The training-script contract shared by the rendered DeepSpeed and torch scripts (torch-free).

Both scripts take the same flags (:func:`contract_parser`) and embed the parts of
plan.json they depend on (:func:`planned_layout`); at start-up they refuse a
plan.json edited since rendering (:func:`read_plan`), so an edited stage
boundary cannot silently train a split the other files were not made for.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
LAYOUT_KEYS = ("engine", "schedule", "pp", "dp", "tp", "vp", "micro_batch", "num_microbatches", "global_batch", "recompute", "zero")


class PlanChanged(RuntimeError):
    """plan.json (or another file beside the script) is not what the script was rendered for."""


def planned_layout(plan: dict[str, Any]) -> dict[str, Any]:
    """The parts of plan.json (a dict) a training script's behaviour depends on: the layout, stage ranks and piece ranges."""
    lay = plan["layout"]
    out: dict[str, Any] = {k: lay[k] for k in LAYOUT_KEYS}
    out["stage_ranks"] = [int(s["rank"]) for s in plan["stages"]]
    out["stage_pieces"] = [[int(x) for x in s["pieces"]] for s in plan["stages"]]
    return out


def read_plan(path: str | Path, expected: dict[str, Any]) -> dict[str, Any]:
    """plan.json, refused when what the script depends on differs from ``expected`` (what it was rendered for)."""
    plan: dict[str, Any] = json.loads(Path(path).read_text())
    found = planned_layout(plan)
    diff = sorted(k for k in expected.keys() | found.keys() if found.get(k) != expected.get(k))
    if diff:
        detail = ", ".join(f"{k}: {found.get(k)!r} (rendered for {expected.get(k)!r})" for k in diff)
        raise PlanChanged(f"{path} is not the plan this script was rendered for ({detail}); re-run `planner plan ... --out DIR`.")
    return plan


def contract_parser(description: str, default_plan: str | Path) -> argparse.ArgumentParser:
    """The contract's flags (``--local_rank``/``--local-rank`` from launchers accepted); engines add their own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--plan", default=str(default_plan), help="plan.json (default: the one beside this script)")
    p.add_argument("--model", default=None, help="the model file (default: the path it had when the script was rendered)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0, help="seed of model init and data (identical weights on every rank)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--precision", choices=PRECISIONS, default="auto", help="auto: plan dtype on GPU, fp32 on CPU")
    p.add_argument("--no-dropout", action="store_true", help="disable dropout (for exact loss comparisons)")
    p.add_argument("--losses-out", default=None, help='write {"losses": [...]} here (the rank holding the last stage of replica 0)')
    p.add_argument("--stats-out", default=None, help="per-rank JSON stats; {rank} is replaced by the global rank")
    p.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return p
