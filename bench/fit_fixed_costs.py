"""Fit the profiles' fixed costs (kernel_us, p2p_sync_us) per GPU type on the tune rows of the published runs.

``python -m bench.fit_fixed_costs`` prints the fit; ``--write`` also writes it into the GPU's profile
(hardware_profiles/<key>.yaml, ``fixed_costs`` and ``sources.fixed_costs``) when the fitted values are inside
the physically plausible ranges below, and removes ``fixed_costs`` when they are not.

The two parameters (planner.hardware.profiles, planner.solve.search.fixed_costs):

* ``kernel_us``: the least time one operator of an eager training step takes (back-to-back kernel issue);
* ``p2p_sync_us``: synchronisation each pipeline send/recv adds to its link latency.

Only the tune rows (bench/data/published_runs.yaml, split ``tune``) are used: A100 from Narayanan et al. 2021,
Korthikanti et al. 2022 and the 2021 Megatron-LM README; H100 from the 2024 Megatron-LM README. Each row is priced
with its layout pinned (bench.published_runs.layout_for, the memory check lifted) and the objective is the sum of
squared log errors log(predicted / published) over the GPU type's rows. The minimum is searched on a fixed grid and
refined by coordinate golden-section search inside the grid cell, so the fit is deterministic.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import published_runs as pr

#: the tune sources per GPU type (bench/NOTES.md: the split is by source)
TUNE_SOURCES = {
    "A100-80GB": ("narayanan2021", "korthikanti2022", "megatron_readme_a100"),
    "H100-SXM": ("megatron_readme_h100",),
}
#: search ranges, microseconds: wide enough to hold any value the data asks for, plausible or not
KERNEL_GRID = (0.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0)
P2P_GRID = (0.0, 30.0, 100.0, 300.0, 1000.0, 3000.0, 10000.0, 30000.0)
#: physically plausible ranges, microseconds: a CUDA kernel launch / back-to-back issue costs a few microseconds
#: (NVIDIA, CUDA C++ Best Practices Guide, "kernel launch overhead ... a few microseconds"), and an NCCL send/recv
#: pair between pipeline stages synchronises in tens to hundreds of microseconds (nccl-tests sendrecv latency
#: ~10-30 us on NVLink/InfiniBand at small sizes, plus the stream synchronisation Megatron's p2p adds)
KERNEL_PLAUSIBLE = (1.0, 10.0)
P2P_PLAUSIBLE = (5.0, 500.0)


@dataclass(frozen=True)
class Fit:
    """The least-squares fixed costs of one GPU type, and the log errors before and after."""

    device: str
    kernel_us: float
    p2p_sync_us: float
    rows: tuple[str, ...]
    before: tuple[float, ...]  # log(predicted / published) with no fixed costs
    after: tuple[float, ...]  # the same at the fit

    @property
    def plausible(self) -> bool:
        return KERNEL_PLAUSIBLE[0] <= self.kernel_us <= KERNEL_PLAUSIBLE[1] and P2P_PLAUSIBLE[0] <= self.p2p_sync_us <= P2P_PLAUSIBLE[1]

    @staticmethod
    def rms(errs: Sequence[float]) -> float:
        return math.sqrt(sum(e * e for e in errs) / len(errs))


def tune_rows(device: str) -> list[pr.PublishedRun]:
    """The tune rows of one GPU type."""
    return [r for r in pr.RUNS_ALL if r.split == "tune" and r.source.device == device and r.source.key in TUNE_SOURCES[device]]


def _cluster(run: pr.PublishedRun, **device: float):
    """The row's cluster with these DeviceProfile fields replaced on every device."""
    from planner import hardware

    c = hardware.parse_gpus(f"{run.gpus}x{pr.DEVICE_PROFILE[run.source.device]}")
    return dataclasses.replace(c, groups=tuple(dataclasses.replace(g, device=dataclasses.replace(g.device, **device)) for g in c.groups))


def priced_step(run: pr.PublishedRun, **device: float) -> float:
    """Seconds per step of the row's pinned layout with these DeviceProfile fields replaced (memory check lifted)."""
    from planner.engines import get_engine
    from planner.solve import search
    from planner.solve.settings import Settings

    costs = pr.costs_for(run)
    lay = pr.layout_for(run)
    opts = Settings.of(engine="megatron", global_batch=run.global_batch, mem_target=pr.UNCHECKED, cp=run.cp, fp8=lay.fp8)
    ctx = search.Context(costs, _cluster(run, **device), opts, get_engine("megatron"))
    ev = search.price_layout(ctx, lay, costs.dtype, pr.stage_bounds(run, costs))
    if isinstance(ev, search.Rejection):
        raise ValueError(f"{run.id}: {ev.reason}")
    return ev.predicted.step_time_s


def predicted_step(run: pr.PublishedRun, kernel_us: float, p2p_us: float) -> float:
    """Seconds per step of the row's pinned layout with these fixed costs (memory check lifted)."""
    return priced_step(run, kernel_floor_s=kernel_us * 1e-6, p2p_sync_s=p2p_us * 1e-6)


def log_errors(rows: Sequence[pr.PublishedRun], kernel_us: float, p2p_us: float) -> tuple[float, ...]:
    return tuple(math.log(predicted_step(r, kernel_us, p2p_us) / r.step_s) for r in rows)


def _golden(f: Callable[[float], float], lo: float, hi: float, steps: int = 12) -> float:
    """The minimiser of a unimodal ``f`` on [lo, hi] by golden-section search (``steps`` shrinks)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(steps):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def fit_device(device: str) -> Fit:
    """Least squares in log error over the device's tune rows: the grid's best point, refined within its neighbours."""
    rows = tune_rows(device)
    cache: dict[tuple[float, float], float] = {}

    def sse(k: float, s: float) -> float:
        key = (round(k, 6), round(s, 6))
        if key not in cache:
            cache[key] = sum(e * e for e in log_errors(rows, k, s))
        return cache[key]

    best = min(((k, s) for k in KERNEL_GRID for s in P2P_GRID), key=lambda ks: (sse(*ks), ks))
    i, j = KERNEL_GRID.index(best[0]), P2P_GRID.index(best[1])
    k_lo, k_hi = KERNEL_GRID[max(0, i - 1)], KERNEL_GRID[min(len(KERNEL_GRID) - 1, i + 1)]
    s_lo, s_hi = P2P_GRID[max(0, j - 1)], P2P_GRID[min(len(P2P_GRID) - 1, j + 1)]
    k, s = best
    for _ in range(2):  # coordinate descent: kernel, then p2p, twice
        k = _golden(lambda x: sse(x, s), k_lo, k_hi)
        s = _golden(lambda x: sse(k, x), s_lo, s_hi)
    if sse(*best) <= sse(k, s):
        k, s = best
    k, s = round(k, 1), round(s, 0)
    return Fit(device, k, s, tuple(r.id for r in rows), log_errors(rows, 0.0, 0.0), log_errors(rows, k, s))


def source_line(f: Fit) -> str:
    """The profile's sources.fixed_costs text for a fit."""
    worst = max(range(len(f.rows)), key=lambda i: abs(f.after[i]))
    return (
        f"Fitted by bench/fit_fixed_costs.py (least squares in log step-time error) on the {len(f.rows)} tune rows of "
        f"bench/data/published_runs.yaml for this GPU ({', '.join(TUNE_SOURCES[f.device])}): rms log error "
        f"{Fit.rms(f.before):.3f} without fixed costs, {Fit.rms(f.after):.3f} with them, worst row {f.rows[worst]} "
        f"{100 * math.expm1(f.after[worst]):+.1f}%. Inside the plausible ranges kernel {KERNEL_PLAUSIBLE[0]:g}-{KERNEL_PLAUSIBLE[1]:g} us, "
        f"p2p sync {P2P_PLAUSIBLE[0]:g}-{P2P_PLAUSIBLE[1]:g} us."
    )


def profile_path(device: str) -> Path:
    from planner.resources import hardware_profiles_dir

    return hardware_profiles_dir() / f"{pr.DEVICE_PROFILE[device].lower()}.yaml"


def write_profile(f: Fit, path: Path) -> None:
    """Set (plausible fit) or remove (implausible) ``fixed_costs`` and its source line in the profile YAML text."""
    lines = [ln for ln in path.read_text().splitlines() if not re.match(r"^fixed_costs:|^  fixed_costs:", ln)]
    if f.plausible:
        at = next(i for i, ln in enumerate(lines) if ln.startswith("sources:"))
        lines.insert(at, f"fixed_costs: {{kernel_us: {f.kernel_us:g}, p2p_sync_us: {f.p2p_sync_us:g}}}")
        lines.append(f"  fixed_costs: {_quote(source_line(f))}")
    path.write_text("\n".join(lines) + "\n")


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def report(fits: Sequence[Fit]) -> str:
    out = []
    for f in fits:
        verdict = "plausible" if f.plausible else "NOT plausible"
        out.append(
            f"{f.device}: kernel_us {f.kernel_us:g}, p2p_sync_us {f.p2p_sync_us:g} ({verdict}); rms log error {Fit.rms(f.before):.3f} -> {Fit.rms(f.after):.3f}"
        )
        for rid, b, a in zip(f.rows, f.before, f.after):
            out.append(f"  {rid:10s} {100 * math.expm1(b):+6.1f}% -> {100 * math.expm1(a):+6.1f}%")
    return "\n".join(out)


def shipped_agrees(f: Fit) -> bool:
    """Whether the GPU's bundled profile carries what the fit decides: the fitted values when plausible, none otherwise."""
    from planner.hardware import load_profile

    p = load_profile(profile_path(f.device))
    want = (f.kernel_us * 1e-6, f.p2p_sync_us * 1e-6) if f.plausible else (0.0, 0.0)
    return all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip((p.kernel_floor_s, p.p2p_sync_s), want))


def markdown(fits: Sequence[Fit]) -> str:
    """The fit per GPU type, each tune row's error without and with it, and whether the bundled profile agrees."""
    out = ["| GPU | kernel_us | p2p_sync_us | plausible | rms log error without -> with | bundled profile agrees |", "|---|---:|---:|---|---|---|"]
    for f in fits:
        out.append(
            f"| {f.device} | {f.kernel_us:g} | {f.p2p_sync_us:g} | {'yes' if f.plausible else 'no'} | "
            f"{Fit.rms(f.before):.3f} -> {Fit.rms(f.after):.3f} | {'yes' if shipped_agrees(f) else '**no**: run --write'} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fit_fixed_costs", description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write the fit into the GPUs' profiles (only plausible values are kept)")
    ap.add_argument("--device", choices=sorted(TUNE_SOURCES), action="append", help="fit only this GPU type (repeatable)")
    ns = ap.parse_args(argv)
    fits = [fit_device(d) for d in (ns.device or sorted(TUNE_SOURCES))]
    print(report(fits))
    if ns.write:
        for f in fits:
            write_profile(f, profile_path(f.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
