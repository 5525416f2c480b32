"""Leave-one-source-out step-time error of the dense published runs: the figure that says how the time model does on
runs it was not fitted to.

``python -m bench.loso`` prints the table RESULTS.md carries.

What is fitted: one number per GPU type, the profiles' ``efficiency.sustained`` (bench/fit_sustained.py; the fixed
costs of bench/fit_fixed_costs.py are not shipped, and every other profile figure is sourced). For each source group
of the dense rows (bench/data/published_runs.yaml; one source is one GPU type), that number is refitted on the rows
of the same GPU type from every other source, tune and test alike, and the group's rows are predicted with it. The
fit is the least-squares minimiser in log(predicted / published) over the grid 0.60, 0.61, ..., 1.00 (the shipped
fit is rounded to that grid too), each row priced with its published layout pinned and the memory check lifted
(bench.fit_fixed_costs.priced_step). Reported over the rows bench.published_runs prices (those predicted to fit at
--mem-target 1.0), next to the error of the shipped profiles (in-sample for the tune sources, whose rows the shipped
value was fitted on; out-of-sample for the test sources).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from bench import published_runs as pr
from bench.fit_fixed_costs import priced_step

#: the sustained fractions tried (the shipped values, 0.95 and 0.79, lie on it)
GRID = tuple(round(0.60 + 0.01 * i, 2) for i in range(41))


@dataclass(frozen=True)
class GroupResult:
    """One source group: its rows, the value refitted without it, and the signed errors of its priced rows (shipped
    profile, and refitted)."""

    source: str
    split: str
    device: str
    refit: float
    shipped: float
    rows: tuple[str, ...]
    shipped_errors: tuple[float, ...]
    loso_errors: tuple[float, ...]


def dense_rows() -> list[pr.PublishedRun]:
    """The dense published runs the planner can express (bench.published_runs.not_expressible)."""
    return [r for r in pr.RUNS_ALL if r.model.arch != "moe" and not pr.not_expressible(r)]


def step_table(rows: Sequence[pr.PublishedRun]) -> dict[str, dict[float, float]]:
    """Predicted seconds per step of each row at each :data:`GRID` value."""
    return {r.id: {s: priced_step(r, sustained_matmul=s) for s in GRID} for r in rows}


def fit(rows: Sequence[pr.PublishedRun], table: dict[str, dict[float, float]]) -> float:
    """The :data:`GRID` value minimising the sum of squared log errors over ``rows`` (the smallest of equals)."""
    return min(GRID, key=lambda s: (sum(math.log(table[r.id][s] / r.step_s) ** 2 for r in rows), s))


def shipped_value(device: str) -> float:
    from bench.fit_fixed_costs import profile_path
    from planner.hardware import load_profile

    return load_profile(profile_path(device)).sustained_matmul


def leave_one_source_out(rows: Sequence[pr.PublishedRun], table: dict[str, dict[float, float]], priced: set[str]) -> list[GroupResult]:
    """Per source group: refit on the same GPU type's other sources, predict the group's priced rows."""
    out = []
    for key in sorted({r.source.key for r in rows}):
        group = [r for r in rows if r.source.key == key]
        device = group[0].source.device
        others = [r for r in rows if r.source.device == device and r.source.key != key]
        refit = fit(others, table) if others else shipped_value(device)
        shipped = shipped_value(device)
        mine = [r for r in group if r.id in priced]
        out.append(
            GroupResult(
                key,
                group[0].split,
                device,
                refit,
                shipped,
                tuple(r.id for r in mine),
                tuple(math.expm1(math.log(table_or_price(table, r, shipped) / r.step_s)) for r in mine),
                tuple(math.expm1(math.log(table[r.id][refit] / r.step_s)) for r in mine),
            )
        )
    return out


def table_or_price(table: dict[str, dict[float, float]], run: pr.PublishedRun, s: float) -> float:
    return table[run.id][s] if s in table[run.id] else priced_step(run, sustained_matmul=s)


def _mae(xs: Sequence[float]) -> float:
    return sum(abs(x) for x in xs) / len(xs) if xs else math.nan


def markdown(results: Sequence[GroupResult]) -> str:
    lines = [
        "| source (split) | GPU | priced rows | sustained: shipped / refitted without it | mean abs. error, shipped | mean abs. error, left out | worst row left out |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    for g in results:
        if not g.rows:
            lines.append(f"| {g.source} ({g.split}) | {g.device} | 0 | {g.shipped:.2f} / {g.refit:.2f} | | | |")
            continue
        worst = max(range(len(g.rows)), key=lambda i: abs(g.loso_errors[i]))
        lines.append(
            f"| {g.source} ({g.split}) | {g.device} | {len(g.rows)} | {g.shipped:.2f} / {g.refit:.2f} | {100 * _mae(g.shipped_errors):.1f}% | "
            f"{100 * _mae(g.loso_errors):.1f}% | {g.rows[worst]} {100 * g.loso_errors[worst]:+.1f}% |"
        )
    shipped = [e for g in results for e in g.shipped_errors]
    loso = [e for g in results for e in g.loso_errors]
    worst_group = max((g for g in results if g.rows), key=lambda g: _mae(g.loso_errors))
    lines += [
        "",
        f"All {len(loso)} priced dense rows over {sum(1 for g in results if g.rows)} sources: mean absolute error {100 * _mae(shipped):.1f}% with the "
        f"shipped profiles, {100 * _mae(loso):.1f}% with each source left out of the fit; the worst group left out is "
        f"{worst_group.source} at {100 * _mae(worst_group.loso_errors):.1f}%.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    rows = dense_rows()
    priced = {p.run.id for p in pr.predict_all() if p.error is not None}
    table = step_table(rows)
    print(markdown(leave_one_source_out(rows, table, priced)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
