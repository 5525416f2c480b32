"""Smoke vs prediction on this CPU: the measured step time of a real 2-rank pipeline against the planner's prediction.

Three predictions for the same plan: the bundled ``cpu`` profile (placeholder
numbers), a profile calibrated on this machine (``planner profile --calibrate``:
measured matmul FLOP/s and copy bandwidth), and per-piece times measured on this
machine (``planner plan --profile``), both measured on one thread, as each rank runs.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "gpt2.py"
ARGS = {"preset": "gpt2", "n_layer": 4, "seq_len": 256}
PINS = dict(pp=2, dp=1, micro_batch=4, global_batch=16, schedule="1f1b", recompute="none")


def run() -> dict:
    import torch

    from planner.check.smoke import smoke
    from planner.fileio import write_text_atomic
    from planner.hardware.calibrated import profile_to_hardware_yaml
    from planner.model.profile import profile_model, write_profile
    from planner.planning import plan_model
    from planner.render import write_plan_dir
    from planner.solve.settings import Settings

    work = Path(tempfile.mkdtemp(prefix="planner-bench-smoke-"))
    # each of the 2 ranks runs on one core (OMP_NUM_THREADS=1): measure and calibrate the same way
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prof = profile_model(MODEL, ARGS, "cpu", PINS["micro_batch"], "fp32", warmup=2, repeats=5, calibrate=True)
    finally:
        torch.set_num_threads(threads)
    write_profile(work / "profile.json", prof)
    hw = work / "cpu-calibrated.yaml"
    write_text_atomic(hw, profile_to_hardware_yaml(prof))
    base = dict(model_file=str(MODEL), model_args=ARGS, gpus="2xcpu", engine="torch", dtype="fp32", cost_micro_batch=PINS["micro_batch"], **PINS)
    predictions = {}
    for name, extra in (
        ("bundled cpu profile", {}),
        ("calibrated on this CPU", {"gpus": "2xcpu-calibrated", "hardware_profiles": (str(hw),)}),
        ("measured per-piece times", {"profile": str(work / "profile.json")}),
    ):
        plan, _, _ = plan_model(Settings.of(**{**base, **extra}))
        predictions[name] = plan
    plan = predictions["bundled cpu profile"]
    write_plan_dir(work / "plan", plan, "planner plan (bench)")
    result = smoke(work / "plan", steps=5, device="cpu")
    measured = max(statistics.median(s["step_times_s"][1:]) for s in result.ranks_stats) if result.ranks_stats else float("nan")
    return {
        "ok": result.ok,
        "measured_step_s": measured,
        "predicted": {k: p.predicted.step_time_s for k, p in predictions.items()},
        "bubble": {k: p.predicted.bubble_fraction for k, p in predictions.items()},
        "calibration": prof.get("calibration"),
        "max_relative_loss_difference": result.max_relative_difference,
        "layout": plan.layout.short(),
    }


def markdown(r: dict) -> str:
    lines = [
        f"gpt2 (4 layers, seq 256), torch engine, {r['layout']}, fp32, 2 gloo ranks on this CPU. "
        f"Smoke passed: {r['ok']} (losses equal a single-process run within {r['max_relative_loss_difference']:.1e}).",
        "",
        "| prediction from | predicted step | measured step | measured / predicted |",
        "|---|---:|---:|---:|",
    ]
    for name, pred in r["predicted"].items():
        lines.append(f"| {name} | {pred * 1e3:.1f} ms | {r['measured_step_s'] * 1e3:.1f} ms | {r['measured_step_s'] / pred:.2f} |")
    cal = r.get("calibration") or {}
    if cal:
        mm = cal.get("matmul", {}).get("fp32", {})
        lines.append("")
        lines.append(
            f"Calibration on this CPU: fp32 matmul {mm.get('flops_per_s', float('nan')) / 1e9:.1f} GFLOP/s "
            f"(n = {mm.get('n')}), copy {cal.get('copy', {}).get('bytes_per_s', float('nan')) / 1e9:.1f} GB/s."
        )
    return "\n".join(lines)
