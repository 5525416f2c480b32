"""Fit each GPU type's sustained GEMM rate (the profiles' ``efficiency.sustained``) on the tune rows of the published runs.

``python -m bench.fit_sustained`` prints the fit per GPU type and whether the bundled profile carries it.

The profiles' matmul rates are short-loop GEMM measurements: the best iteration of stas00's MAMF finder
(github.com/stas00/ml-engineering, compute/accelerator/benchmarks/mamf-finder.py, ``--iterations`` timed after a
warm-up, the fastest kept) and OpenXLA's matmul table. A training step runs GEMMs back to back for seconds, and a
GPU's firmware lowers the SM clock to hold its power limit: on a B200, sustained back-to-back kernels moved the SM clock
from 1965 to ~1580 MHz and cost up to 15% of the TFLOP/s (flashinfer-ai/flashinfer pull request 2899, 2026-03); the
MAMF finder's author keeps a warm-up because a cold GPU's first GEMMs are faster than it can sustain
(stas00/ml-engineering pull request 59). ``efficiency.sustained`` is the fraction of the measured rates held through
a step; it multiplies every GEMM's rate (planner.hardware.device_time.matmul_efficiency_at), not memory-bound
kernels (HBM runs on its own clock).

No profile states it, so it is fitted, one number per GPU type, on that type's tune rows only (bench/NOTES.md: the
split is by source; the test rows are never seen): each row priced with its layout pinned (the memory check lifted),
least squares in log(predicted / published), golden-section search on [0.6, 1], rounded to 0.01. A value is shipped
only when it is physically plausible: at most 1 (no GPU beats its own measured rate for long) and at least 0.7 (a
clock 30% under the short-loop one; the B200 measurement above is 20%).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from bench import published_runs as pr
from bench.fit_fixed_costs import TUNE_SOURCES, _golden, priced_step, profile_path, tune_rows

#: the search interval and the range a shipped value must lie in
SEARCH = (0.6, 1.0)
PLAUSIBLE = (0.7, 1.0)


@dataclass(frozen=True)
class SustainedFit:
    """The least-squares sustained fraction of one GPU type and its tune rows' log errors at 1 and at the fit."""

    device: str
    sustained: float
    rows: tuple[str, ...]
    before: tuple[float, ...]
    after: tuple[float, ...]

    @property
    def plausible(self) -> bool:
        return PLAUSIBLE[0] <= self.sustained <= PLAUSIBLE[1]


def predicted_step(run: pr.PublishedRun, sustained: float) -> float:
    """Seconds per step of the row's pinned layout with GEMMs at ``sustained`` of the profile's rates (memory check lifted)."""
    return priced_step(run, sustained_matmul=sustained)


def log_errors(rows: Sequence[pr.PublishedRun], sustained: float) -> tuple[float, ...]:
    return tuple(math.log(predicted_step(r, sustained) / r.step_s) for r in rows)


def fit_device(device: str) -> SustainedFit:
    """Least squares in log error over the device's tune rows, by golden-section search on :data:`SEARCH`."""
    rows = tune_rows(device)
    s = round(_golden(lambda x: sum(e * e for e in log_errors(rows, x)), *SEARCH, steps=14), 2)
    return SustainedFit(device, s, tuple(r.id for r in rows), log_errors(rows, 1.0), log_errors(rows, s))


def _rms(errs: Sequence[float]) -> float:
    return math.sqrt(sum(e * e for e in errs) / len(errs))


def shipped_agrees(f: SustainedFit) -> bool:
    """Whether the GPU's bundled profile carries the fit (1 when the fit is not plausible)."""
    from planner.hardware import load_profile

    want = f.sustained if f.plausible else 1.0
    return math.isclose(load_profile(profile_path(f.device)).sustained_matmul, want, abs_tol=1e-9)


def markdown(fits: Sequence[SustainedFit]) -> str:
    """The fit per GPU type, its tune rows' rms log error at 1 and at the fit, and whether the bundled profile agrees."""
    out = ["| GPU | tune rows | sustained | plausible | rms log error at 1 -> at the fit | worst tune row at the fit | bundled profile agrees |"]
    out.append("|---|---:|---:|---|---|---|---|")
    for f in fits:
        worst = max(range(len(f.rows)), key=lambda i: abs(f.after[i]))
        out.append(
            f"| {f.device} | {len(f.rows)} | {f.sustained:.2f} | {'yes' if f.plausible else 'no'} | {_rms(f.before):.3f} -> {_rms(f.after):.3f} | "
            f"{f.rows[worst]} {100 * math.expm1(f.after[worst]):+.1f}% | {'yes' if shipped_agrees(f) else '**no**'} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    fits = [fit_device(d) for d in sorted(TUNE_SOURCES)]
    print(markdown(fits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
