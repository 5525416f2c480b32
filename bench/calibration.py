"""`planner calibrate` end to end on this CPU: fit on one real run, predict another.

examples/gpt2.py (4 layers, hidden 256, seq 128, vocabulary 1024), torch engine, pp2 1f1b, micro-batch 4 x 4,
fp32, 2 gloo ranks (one thread each). `planner smoke` measures it; `planner calibrate` fits the bundled
``cpu`` profile's placeholders to that run; then the same model twice as deep (8 layers) is planned with the
calibrated profile and with the bundled one, and smoked, and so is a different layout of the 4-layer model
(pp1 dp2, micro-batch 4 x 2: no pipeline, a gradient all-reduce): the measured steps against both predictions.
Wall-clock steps on a shared machine: the calibration layout is smoked before and after the checked runs, and the
fit uses both, so the fit and the checks see the same load.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "gpt2.py"
ARGS = {"preset": "gpt2-tiny", "n_embd": 256, "seq_len": 128, "vocab_size": 1024}
COMMON = ("--engine", "torch", "--micro-batch", "4", "--global-batch", "16", "--schedule", "1f1b", "--recompute", "none", "--dtype", "fp32")
PP2 = ("--pp", "2", "--dp", "1")
DP2 = ("--pp", "1", "--dp", "2")
STEPS = 8


def _invoke(*args) -> str:
    from typer.testing import CliRunner

    from planner.cli import app

    r = CliRunner().invoke(app, [str(a) for a in args])
    if r.exit_code != 0:
        raise RuntimeError(f"planner {' '.join(map(str, args[:2]))} failed ({r.exit_code}):\n{r.output}")
    return r.output


def _plan(out: Path, gpus: str, model_args: dict, layout: tuple, *extra) -> dict:
    margs = [x for k, v in model_args.items() for x in ("--model-arg", f"{k}={v}")]
    _invoke("plan", MODEL, *margs, "--gpus", gpus, *COMMON, *layout, "--out", out, "--quiet", *extra)
    return json.loads((out / "plan.json").read_text())


def _measured(d: Path) -> float:
    from planner.check.run_logs import read_smoke

    return read_smoke(d / "smoke.json").step_time(16)


def run(work: Path | None = None) -> dict:
    """Plan, smoke, calibrate, re-plan deeper, smoke; the figures (seconds) and the fit's report."""
    work = Path(work or tempfile.mkdtemp(prefix="planner-bench-calibrate-"))
    import shutil

    fit_dir, fit_again = work / "fit-a", work / "fit-b"
    fit_plan = _plan(fit_dir, "2xcpu", ARGS, PP2)
    shutil.copytree(fit_dir, fit_again)
    cases = (("8 layers, pp2 mb4x4", {**ARGS, "n_layer": 8}, PP2), ("4 layers, pp1 dp2 mb4x2", ARGS, DP2))
    dirs = [work / label.replace(" ", "-").replace(",", "") for label, _, _ in cases]
    plans = [_plan(d, "2xcpu", model_args, layout) for d, (_, model_args, layout) in zip(dirs, cases)]
    for d in (fit_dir, *dirs, fit_again):  # the check runs bracketed by the two calibration runs: the same load
        _invoke("smoke", d, "--steps", STEPS)
    profile = work / "cpu-bench.yaml"
    report = _invoke("calibrate", fit_dir, fit_again, "--name", "cpu-bench", "--out", profile)
    checks = []
    for d, plan, (label, model_args, layout) in zip(dirs, plans, cases):
        cal = _plan(work / (d.name + "-cal"), "2xcpu-bench", model_args, layout, "--hardware-profile", profile)
        if [s["pieces"] for s in cal["stages"]] != [s["pieces"] for s in plan["stages"]]:
            raise RuntimeError(f"{label}: the calibrated plan splits the model differently from the run")
        checks.append(
            {"run": label, "measured_s": _measured(d), "calibrated_s": cal["predicted"]["step_time_s"], "uncalibrated_s": plan["predicted"]["step_time_s"]}
        )
    return {
        "fit_measured_s": (_measured(fit_dir), _measured(fit_again)),
        "fit_uncalibrated_s": fit_plan["predicted"]["step_time_s"],
        "checks": checks,
        "report": report,
        "profile": profile.read_text(),
    }


def markdown(r: dict) -> str:
    def err(pred: float, meas: float) -> str:
        return f"{pred / meas - 1:+.0%}"

    fitted = [line.split(":")[0].replace("fitted ", "") for line in r["report"].splitlines() if line.startswith("fitted ")]
    lines = [
        "| run | measured step | bundled cpu profile | calibrated profile |",
        "|---|---:|---:|---:|",
        (
            f"| fitted on: 4 layers, pp2 mb4x4 (run before and after the others) | {r['fit_measured_s'][0] * 1e3:.0f} / {r['fit_measured_s'][1] * 1e3:.0f} ms | "
            f"{r['fit_uncalibrated_s'] * 1e3:.0f} ms ({err(r['fit_uncalibrated_s'], statistics.geometric_mean(r['fit_measured_s']))}) | (fitted) |"
        ),
    ]
    for c in r["checks"]:
        lines.append(
            f"| predicted: {c['run']} | {c['measured_s'] * 1e3:.0f} ms | {c['uncalibrated_s'] * 1e3:.0f} ms ({err(c['uncalibrated_s'], c['measured_s'])}) | "
            f"{c['calibrated_s'] * 1e3:.0f} ms ({err(c['calibrated_s'], c['measured_s'])}) |"
        )
    lines += [
        "",
        "Fitted from the two runs of one layout: " + "; ".join(fitted) + " (one layout cannot separate them: they move together).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    res = run()
    print(markdown(res))
