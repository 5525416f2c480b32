"""`planner inspect` on the largest presets: wall time and peak RSS of the whole command (a fresh process each)."""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = (("llama-70b", "llama"), ("llama-405b", "llama"), ("gpt-1t", "gpt2"))


def run() -> list[dict]:
    out = []
    for preset, example in CASES:
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "planner", "inspect", str(ROOT / "examples" / f"{example}.py"), "--model-arg", f"preset={preset}", "--json"],
            check=True,
            capture_output=True,
        )
        wall = time.perf_counter() - t0
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        out.append({"preset": preset, "wall_s": wall, "peak_rss_bytes": max(rss, before) * 1024})
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| model | `planner inspect` wall time | peak RSS |", "|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['wall_s']:.1f} s | {r['peak_rss_bytes'] / 2**30:.2f} GiB |")
    lines.append("")
    lines.append(
        "Peak RSS is the largest of the child processes so far (ru_maxrss of children), so each row is at most the true peak of that run or an earlier one."
    )
    return "\n".join(lines)
