"""Planning speed and memory: tracing and search timed separately, peak RSS, for Llama 7B/70B/405B on 8 to 16384 GPUs,
and the mixture-of-experts searches (ep x etp searched too) of Mixtral 8x7B on 64 and DeepSeek-V3 on 1024 H100 (Megatron).

Each model runs in its own process (``python -m bench.planning_speed MODEL``) so peak RSS is that model's alone.

``python -m bench.planning_speed whole`` times the whole command as a user runs it (``planner plan ... --engine
megatron --quiet``: import, trace, cost, search and render) for the four cases of the planning-speed targets, each the
median of ``WHOLE_RUNS`` runs, wall and CPU seconds (the child's user + system time).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ("llama-7b", "llama-70b", "llama-405b")
GPUS = ("8xH100", "64xH100", "1024xH100", "16384xH100")
ENGINES = ("megatron", "deepspeed")
#: examples/moe.py presets -> the clusters they are searched on (Megatron: the engine with expert parallelism)
MOE_CASES = {"mixtral-8x7b": ("64xH100",), "deepseek-v3": ("1024xH100",)}
MOE_ENGINES = ("megatron",)


def measure(preset: str) -> dict:
    from planner import hardware
    from planner.engines import get_engine
    from planner.model.analyze import analyze
    from planner.solve.search import search
    from planner.solve.settings import Settings

    moe = preset in MOE_CASES
    t0 = time.perf_counter()
    costs = analyze(ROOT / "examples" / ("moe.py" if moe else "llama.py"), {"preset": preset}, 1, "bf16").costs
    trace_s = time.perf_counter() - t0
    rss_trace = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows = []
    for gpus in MOE_CASES[preset] if moe else GPUS:
        cluster = hardware.parse_gpus(gpus)
        for engine in MOE_ENGINES if moe else ENGINES:
            t0 = time.perf_counter()
            res = search(costs, cluster, Settings.of(engine=engine), get_engine(engine))
            rows.append(
                {
                    "gpus": gpus,
                    "engine": engine,
                    "search_s": time.perf_counter() - t0,
                    "considered": res.considered,
                    "priced": res.priced,
                    "best": res.best.layout.short() if res.best else None,
                }
            )
    return {
        "preset": preset,
        "moe": moe,
        "pieces": costs.n,
        "trace_cost_s": trace_s,
        "rss_after_trace_bytes": rss_trace,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "searches": rows,
    }


#: the whole-command cases: (name, model file, preset, --gpus), targets of the planning-speed issue in seconds (cold)
WHOLE_CASES = (
    ("GPT-3 175B on 1024 H100", "gpt2.py", "gpt3-175b", "1024xH100", 10.0),
    ("Llama 70B on 1024 H100", "llama.py", "llama-70b", "1024xH100", 8.0),
    ("Llama 405B on 16384 H100", "llama.py", "llama-405b", "16384xH100", 15.0),
    ("DeepSeek-V3 on 1024 H100", "moe.py", "deepseek-v3", "1024xH100", 10.0),
)
WHOLE_RUNS = 3


def whole_command(model: str, preset: str, gpus: str, runs: int = WHOLE_RUNS, warm: bool = False) -> dict:
    """Median wall and CPU seconds of ``planner plan`` run as its own process, and the layout it picks: with a cold
    cache of analysed models (an empty one for each run), or ``warm`` (one run fills it first, untimed)."""
    import os
    import statistics
    import tempfile

    walls, cpus, picked = [], [], ""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "PLANNER_CACHE": "on", "PLANNER_CACHE_DIR": cache}
        command = [
            sys.executable,
            "-m",
            "planner",
            "plan",
            str(ROOT / "examples" / model),
            "--model-arg",
            f"preset={preset}",
            "--gpus",
            gpus,
            "--engine",
            "megatron",
            "--quiet",
        ]
        if warm:
            subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as tmp:
                if not warm:
                    for entry in Path(cache).rglob("*.json"):
                        entry.unlink()
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                t0 = time.perf_counter()
                proc = subprocess.run([*command, "--out", os.path.join(tmp, "plan")], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
                walls.append(time.perf_counter() - t0)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
                picked = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "runs": runs, "layout": picked}


def _cold_and_warm(model: str, preset: str, gpus: str) -> tuple[dict, dict]:
    cold, warm = whole_command(model, preset, gpus), whole_command(model, preset, gpus, warm=True)
    if cold["layout"] != warm["layout"]:
        raise AssertionError(f"{preset} on {gpus}: {cold['layout']} without the cache, {warm['layout']} with it")
    return cold, warm


#: the target of a run with a warm cache of analysed models (issue: each case under 5 s)
WARM_TARGET_S = 5.0


def whole_markdown(rows: list[tuple[str, float, dict, dict]]) -> str:
    lines = ["| case | cold cache: wall (median) | CPU | target | warm cache: wall | CPU | target | layout |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, target, cold, warm in rows:
        lines.append(
            f"| {name} | {cold['wall_s']:.1f} s | {cold['cpu_s']:.1f} s | {target:g} s | {warm['wall_s']:.1f} s | {warm['cpu_s']:.1f} s "
            f"| {WARM_TARGET_S:g} s | `{cold['layout']}` |"
        )
    return "\n".join(lines)


def run_all() -> list[dict]:
    out = []
    for preset in (*PRESETS, *MOE_CASES):
        proc = subprocess.run([sys.executable, "-m", "bench.planning_speed", preset], cwd=ROOT, capture_output=True, text=True, check=True)
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


def markdown(results: list[dict]) -> str:
    lines = [
        "| model | pieces | trace + cost | peak RSS | " + " | ".join(f"search {g} ({e})" for g in GPUS for e in ENGINES) + " |",
        "|---|---:|---:|---:|" + "---:|" * (len(GPUS) * len(ENGINES)),
    ]
    dense = [r for r in results if not r.get("moe")]
    moe = [r for r in results if r.get("moe")]
    for r in dense:
        cells = []
        for g in GPUS:
            for e in ENGINES:
                s = next(x for x in r["searches"] if x["gpus"] == g and x["engine"] == e)
                cells.append(f"{s['search_s']:.2f} s ({s['priced']}/{s['considered']})")
        lines.append(f"| {r['preset']} | {r['pieces']} | {r['trace_cost_s']:.1f} s | {r['peak_rss_bytes'] / 2**30:.2f} GiB | " + " | ".join(cells) + " |")
    if moe:
        lines += ["", "| MoE model (megatron) | pieces | trace + cost | peak RSS | cluster | search |", "|---|---:|---:|---:|---|---:|"]
        for r in moe:
            for s in r["searches"]:
                head = f"| {r['preset']} | {r['pieces']} | {r['trace_cost_s']:.1f} s | {r['peak_rss_bytes'] / 2**30:.2f} GiB |"
                lines.append(f"{head} {s['gpus']} | {s['search_s']:.2f} s ({s['priced']}/{s['considered']}) |")
    lines.append("")
    lines.append("Search cells: wall time (layouts priced / layouts considered). Best layouts:")
    lines.append("")
    for r in results:
        for s in r["searches"]:
            if s["engine"] == "megatron":
                lines.append(f"- {r['preset']} on {s['gpus']}: {s['best'] or 'nothing fits'}")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] == ["whole"]:
        print(whole_markdown([(name, target, *_cold_and_warm(model, preset, gpus)) for name, model, preset, gpus, target in WHOLE_CASES]))
    else:
        print(json.dumps(measure(sys.argv[1])))
