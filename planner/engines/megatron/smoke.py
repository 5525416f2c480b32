"""``planner smoke`` of a Megatron plan: Megatron-LM's schedules need CUDA, so on a machine without it the rendered flags
are checked with Megatron-LM's argument rules and megatron-core's TransformerConfig instead of training; with CUDA and
``--megatron-path`` pretrain_gpt.py runs for real."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from planner.check.smoke import Check, SmokeResult, _kill_group
from planner.errors import UsageError
from planner.solve.plan import Plan


def run(plan: Plan, plan_dir: Path, device: str, megatron_path: str | None, timeout: float) -> SmokeResult:
    """Megatron cannot train on CPU: check the rendered flags with megatron-core and the validate rules instead."""
    from planner.engines.megatron.architecture import check_megatron_args
    from planner.engines.megatron.script import parse_megatron_args

    lay = plan.layout
    result = SmokeResult(str(plan_dir), "megatron", device, lay.world, 0, [], lay.to_dict(), trained=False)
    script = plan_dir / "pretrain_gpt.sh"
    if not script.is_file():
        raise UsageError(f"{script} is missing.", "Render the plan with `planner plan ... --engine megatron --out DIR`.")
    args = parse_megatron_args(script.read_text(), "script", path=script)
    findings = [f for f in check_megatron_args(args, lay.world) if f.severity == "error"]
    result.checks.append(Check("flags pass Megatron's argument rules", not findings, "; ".join(f"{f.rule}: {f.message}" for f in findings) or "no errors"))
    from planner.engines.megatron.core_check import transformer_config_check

    ok, detail = transformer_config_check(args)
    result.checks.append(Check("megatron-core TransformerConfig accepts the flags", ok, detail))
    if device == "cuda" and megatron_path:
        env = {**os.environ, "MEGATRON_LM_PATH": str(megatron_path)}
        proc = subprocess.Popen(["bash", str(script)], cwd=plan_dir, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code = None
        result.trained = code == 0
        result.checks.append(Check("pretrain_gpt.py runs", code == 0, f"exit {code}" if code is not None else f"timeout after {timeout:.0f} s"))
    else:
        result.checks.append(
            Check(
                "training run",
                True,
                "no training was run: Megatron-LM's schedules need CUDA"
                + ("" if device == "cuda" else " (this machine has none)")
                + ("" if megatron_path else "; pass --megatron-path with a Megatron-LM checkout on a GPU machine to run pretrain_gpt.py"),
            )
        )
    return result
