"""Show a plan: the terminal summary (report.md and the SVG pictures are added by the report renderer)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from planner.solve.plan import Plan

GiB = 2**30


def print_summary(console: Console, plan: Plan, result=None) -> None:
    """The chosen layout, a per-stage table, and the predicted throughput."""
    lay, pr = plan.layout, plan.predicted
    console.print(f"[bold]{lay.engine}[/]: {lay.short()}")
    table = Table()
    for col in ("stage", "rank", "pieces", "fwd ms", "bwd ms", "GiB", "of GiB"):
        table.add_column(col)
    for s in plan.stages:
        table.add_row(str(s.index), str(s.rank), f"{s.layers[0]} .. {s.layers[1]}", f"{s.time_fwd_s * 1e3:.2f}", f"{s.time_bwd_s * 1e3:.2f}", f"{s.memory_bytes['total'] / GiB:.1f}", f"{s.capacity_bytes / GiB:.1f}")
    console.print(table)
    console.print(
        f"step {pr.step_time_s:.3f} s, {pr.tokens_per_s:,.0f} tokens/s, {pr.tflops_per_gpu:.1f} TFLOP/s per GPU, "
        f"MFU {pr.mfu:.1%}, bubble {pr.bubble_fraction:.1%}"
    )
