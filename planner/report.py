"""Show a plan: the terminal summary (rich), and the report files of a plan directory.

- :func:`print_summary`: what ``planner plan`` and ``planner explain DIR`` print.
- :func:`report_files`: ``report.md`` (what was chosen and why, the stages, the
  assumptions), ``timeline.svg`` and ``memory.svg`` (:mod:`planner.report_svg`).

Everything here reads the :class:`~planner.solve.plan.Plan` record only (the
search result, when given, adds counts), so ``explain`` works from plan.json
alone. Text is deterministic: fixed number formats, plan order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from planner.engines import get_engine
from planner.escape import code_span, markdown_text
from planner.report_svg import COMPONENT_COLOURS, COMPONENTS, memory_bars, memory_svg, timeline_svg
from planner.solve.plan import Layout, Plan, Predicted, StagePlan, load_plan
from planner.solve.schedules import SCHEDULE_INFO
from planner.solve.search import SearchResult
from planner.templating import render_template

__all__ = [
    "print_summary",
    "explain",
    "report_files",
    "report_markdown",
    "bottleneck_stage",
    "most_loaded_rank",
    "layout_differences",
    "compare_predicted",
    "memory_bar_text",
]

GiB = 2**30
BAR_CELLS = 20
COMPONENT_LETTERS = {"weights": "w", "grads": "g", "optimizer": "o", "activations": "a", "buffers": "b", "overhead": "x"}


# ------------------------------------------------------------------- plain facts


def bottleneck_stage(plan: Plan) -> int:
    """Index of the stage with the most compute per micro-batch (forward + backward, recompute included)."""
    return max(plan.stages, key=lambda s: (s.time_fwd_s + s.time_bwd_s, -s.index)).index


def most_loaded_rank(plan: Plan) -> int:
    """Pipeline rank whose memory is the largest share of its capacity."""
    bars = memory_bars(plan)
    return max(bars, key=lambda b: (b.total / b.capacity if b.capacity else 0.0, -b.rank)).rank


def _target(plan: Plan) -> float:
    return float(plan.assumptions.get("mem_target", plan.settings.memory.mem_target) or 0.85)


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 1000 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f}"


def _count(n: float) -> str:
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def _pieces(s: StagePlan) -> str:
    n = s.pieces[1] - s.pieces[0]
    first, last = s.layers
    return first if n == 1 else f"{first} .. {last}"


_LAYOUT_FIELDS = (
    ("pp", "pp"),
    ("tp", "tp"),
    ("dp", "dp"),
    ("ep", "ep"),
    ("etp", "etp"),
    ("vp", "v"),
    ("schedule", "schedule"),
    ("micro_batch", "micro-batch"),
    ("num_microbatches", "micro-batches"),
    ("recompute", "recompute"),
    ("zero", "ZeRO"),
    ("sequence_parallel", "sequence parallel"),
)


def layout_differences(layout: Layout, chosen: Layout) -> list[str]:
    """What ``layout`` changes relative to ``chosen``, e.g. ``["pp 2 (chosen 4)", "schedule 1f1b (chosen zbv)"]``."""
    out = []
    for name, label in _LAYOUT_FIELDS:
        a, b = getattr(layout, name), getattr(chosen, name)
        if a != b:
            out.append(f"{label} {a} (chosen {b})")
    return out


def compare_predicted(alt: Predicted, chosen: Predicted) -> str:
    """Where an alternative's step time goes compared with the chosen one, one sentence (milliseconds)."""
    parts = [f"pipeline {_ms(alt.pipeline_time_s)} vs {_ms(chosen.pipeline_time_s)} ms (bubble {alt.bubble_fraction:.1%} vs {chosen.bubble_fraction:.1%})"]
    if max(alt.dp_comm_exposed_s, chosen.dp_comm_exposed_s) > 0:
        parts.append(f"exposed DP sync {_ms(alt.dp_comm_exposed_s)} vs {_ms(chosen.dp_comm_exposed_s)} ms")
    if max(alt.optimizer_s, chosen.optimizer_s) > 0:
        parts.append(f"optimizer {_ms(alt.optimizer_s)} vs {_ms(chosen.optimizer_s)} ms")
    parts.append(f"peak memory {_gib(alt.peak_memory_bytes)} vs {_gib(chosen.peak_memory_bytes)} GiB")
    return "; ".join(parts)


def _slower(alt: Predicted, chosen: Predicted) -> str:
    if chosen.step_time_s <= 0:
        return ""
    d = alt.step_time_s / chosen.step_time_s - 1.0
    return f"{d:+.1%}"


def memory_bar_text(components: Mapping[str, float], capacity: float, target: float, cells: int = BAR_CELLS) -> Text:
    """A text bar of ``cells`` cells for the device's capacity: one letter per component (w g o a b x), ``|`` at the target.

    The filled length is the total's share of the capacity; its cells go to the components by largest
    remainder, so every letter shown stands for at least half a cell of memory.
    """
    vals = [max(0.0, float(components.get(c, 0))) for c in COMPONENTS]
    total = sum(vals)
    filled = min(cells, round(total / capacity * cells)) if capacity > 0 else 0
    if total > 0 and filled == 0:
        filled = 1
    quotas = [v / total * filled if total > 0 else 0.0 for v in vals]
    alloc = [int(q) for q in quotas]
    order = sorted(range(len(vals)), key=lambda i: (-(quotas[i] - alloc[i]), i))
    for i in order[: filled - sum(alloc)]:
        alloc[i] += 1
    bar = Text()
    for c, n in zip(COMPONENTS, alloc):
        if n:
            bar.append(COMPONENT_LETTERS[c] * n, style=f"white on {COMPONENT_COLOURS[c]}")
    tcell = min(cells - 1, int(target * cells))
    for i in range(filled, cells):
        bar.append("|" if i == tcell else "·", style="red" if i == tcell else "dim")
    if capacity > 0 and total > capacity:
        bar.append("!", style="bold red")
    return bar


def _time_sources_text(plan: Plan) -> str:
    src = list(plan.assumptions.get("time_sources", ["analytical"]))
    prof = plan.settings.cluster.profile
    if src == ["measured"]:
        return f"measured per-layer times ({prof or 'profile.json'})"
    if "measured" in src:
        return f"measured where {prof or 'profile.json'} has the layer, analytical elsewhere"
    return "analytical (FLOPs and bytes at the device's peak x efficiency)"


# ------------------------------------------------------------------ the terminal


def _stage_table(plan: Plan) -> Table:
    lay = plan.layout
    worst = bottleneck_stage(plan)
    split = SCHEDULE_INFO.get(lay.schedule) is not None and SCHEDULE_INFO[lay.schedule].split_backward
    recompute = any(s.time_recompute_s > 0 for s in plan.stages)
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title="stages (per micro-batch)", title_justify="left")
    t.add_column("stage", justify="right")
    t.add_column("rank", justify="right")
    t.add_column("pieces", overflow="fold", max_width=30)
    t.add_column("params", justify="right")
    t.add_column("fwd ms", justify="right")
    t.add_column("bwd ms", justify="right")
    if split:
        t.add_column("of it W", justify="right")
    if recompute:
        t.add_column("recomp", justify="right")
    t.add_column("GiB", justify="right")
    t.add_column("", no_wrap=True)
    for s in sorted(plan.stages, key=lambda s: s.index):
        row = [str(s.index), str(s.rank), _pieces(s), _count(s.params), _ms(s.time_fwd_s), _ms(s.time_bwd_s)]
        if split:
            row.append(_ms(s.time_bwd_weight_s))
        if recompute:
            row.append(_ms(s.time_recompute_s))
        row.append(_gib(s.memory_bytes.get("total", 0)))
        row.append("◀ bottleneck" if s.index == worst else "")
        t.add_row(*row, style="bold" if s.index == worst else None)
    return t


def _memory_table(plan: Plan) -> Table:
    bars = memory_bars(plan)
    target = _target(plan)
    worst = most_loaded_rank(plan)
    same_cap = len({b.capacity for b in bars}) == 1
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title="memory per GPU (GiB)", title_justify="left")
    t.add_column("rank", justify="right")
    if plan.layout.vp > 1:
        t.add_column("stages")
    for c, head in zip(COMPONENTS, ("wts", "grad", "opt", "act", "buf", "ovh")):
        t.add_column(head, justify="right")
    t.add_column("total", justify="right")
    if not same_cap:
        t.add_column("of", justify="right")
    cap = f" of {_gib(bars[0].capacity)}" if same_cap and bars else ""
    t.add_column(f"used{cap} (| {target:.0%})", no_wrap=True)
    for b in bars:
        row: list[Any] = [str(b.rank)]
        if plan.layout.vp > 1:
            row.append(",".join(map(str, b.stages)))
        row += [_gib(b.components[c]) for c in COMPONENTS]
        row.append(_gib(b.total))
        if not same_cap:
            row.append(_gib(b.capacity))
        bar = memory_bar_text(b.components, b.capacity, target)
        bar.append(f" {b.total / b.capacity:.0%}" if b.capacity else "")
        if b.rank == worst:
            bar.append(" ◀", style="bold")
        row.append(bar)
        t.add_row(*row, style="bold" if b.rank == worst else None)
    return t


def _alternatives_table(plan: Plan, width: int) -> Table | None:
    if not plan.alternatives:
        return None
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title="alternatives", title_justify="left", width=width)
    t.add_column("layout", ratio=4)
    t.add_column("predicted, or why not", ratio=5)
    for a in plan.alternatives:
        if a.predicted is not None:
            p = a.predicted
            desc = f"{_ms(p.step_time_s)} ms/step ({_slower(p, plan.predicted)}), MFU {p.mfu:.1%}, bubble {p.bubble_fraction:.1%}"
            t.add_row(a.layout.short(), desc)
        else:
            t.add_row(Text(a.layout.short(), style="dim"), Text(f"rejected: {a.rejected}", style="dim"))
    return t


def print_summary(console: Console, plan: Plan, result: SearchResult | None = None) -> None:
    """Print the chosen layout, the stages, memory per GPU, the prediction and the alternatives.

    ``result`` (a :class:`planner.solve.search.SearchResult`) is optional: it only adds search counts.
    """
    lay, pr = plan.layout, plan.predicted
    world = lay.world
    spec = plan.cluster.get("spec") or plan.settings.cluster.gpus or f"{world} GPUs"
    head = Text()
    head.append(f"{lay.engine}", style="bold")
    head.append(f" on {spec}: ")
    head.append(lay.short(), style="bold cyan")
    console.print(head)
    info = SCHEDULE_INFO.get(lay.schedule)
    console.print(
        f"{world} GPUs = pp {lay.pp} x tp {lay.tp} x dp {lay.dp}; global batch {lay.global_batch} = "
        f"{lay.micro_batch} x {lay.num_microbatches} micro-batches x dp {lay.dp}" + (f"; {lay.vp} stages per rank" if lay.vp > 1 else ""),
        highlight=False,
    )
    console.print(overlaps_line(lay), highlight=False)
    if experts_line(plan):
        console.print(experts_line(plan), highlight=False)
    if info is not None:
        console.print(Text(info.description, style="dim"))
    console.print()
    console.print(_stage_table(plan))
    ws = next(s for s in plan.stages if s.index == bottleneck_stage(plan))
    mean = sum(s.time_fwd_s + s.time_bwd_s for s in plan.stages) / len(plan.stages)
    worst_t = ws.time_fwd_s + ws.time_bwd_s
    line = f"bottleneck: stage {ws.index} on rank {ws.rank}, {_ms(worst_t)} ms per micro-batch (fwd + bwd)"
    if len(plan.stages) > 1 and mean > 0:
        line += f", {worst_t / mean - 1:+.0%} vs the mean stage"
    if any(s.time_recompute_s > 0 for s in plan.stages):
        line += "; bwd includes recomputation"
    console.print(line, highlight=False)
    console.print()
    console.print(_memory_table(plan))
    console.print(Text("bar: 1 cell = 5% of the GPU; w weights, g grads, o optimizer, a activations, b buffers, x overhead; ◀ most loaded", style="dim"))
    console.print()
    step = Text()
    step.append(f"predicted step {_ms(pr.step_time_s)} ms", style="bold")
    step.append(f" = pipeline {_ms(pr.pipeline_time_s)} + exposed DP sync {_ms(pr.dp_comm_exposed_s)} + optimizer {_ms(pr.optimizer_s)} ms")
    console.print(step, highlight=False)
    console.print(
        f"{pr.tokens_per_s:,.0f} tokens/s, {pr.samples_per_s:,.1f} samples/s, {pr.tflops_per_gpu:.1f} TFLOP/s per GPU, "
        f"MFU {pr.mfu:.1%}, bubble {pr.bubble_fraction:.1%}",
        highlight=False,
    )
    console.print(Text(f"loss trained: {trained_loss_text(plan)}", style="dim"))
    console.print(Text(f"compute times: {_time_sources_text(plan)}", style="dim"))
    console.print(Text("memory and communication: analytical", style="dim"))
    considered: int | None
    priced: int | None
    rejected: int | None
    if result is not None:
        considered, priced, rejected = result.considered, result.priced, len(result.rejected)
    else:
        considered, priced, rejected = plan.assumptions.get("layouts_considered"), plan.assumptions.get("layouts_priced"), None
    if considered is not None:
        line = f"searched {considered} layouts, priced {priced}" + (f", rejected {rejected}" if rejected is not None else "")
        console.print(Text(line, style="dim"))
    alts = _alternatives_table(plan, min(console.width, 120))
    if alts is not None:
        console.print()
        console.print(alts)
    for note in plan.notes:
        console.print(Text(f"note: {note}", style="yellow"))


def trained_loss_text(plan: Plan) -> str:
    """Which loss the plan's scripts train: the engine's own where it builds the model, else plan.json's model.loss."""
    loss = plan.model.get("loss")
    recorded = str(loss["text"]) if isinstance(loss, dict) and loss.get("text") else "not recorded (a plan made by an older planner)"
    if isinstance(loss, dict) and loss.get("coupling"):
        recorded += f"; it couples the samples of a micro-batch ({loss['coupling']}), so the micro-batch size is part of the objective"
    return get_engine(plan.layout.engine).trained_loss(recorded)


def explain(console: Console, plan_dir: str | Path) -> Plan:
    """``planner explain DIR``: read DIR/plan.json (or a plan.json path) and print its summary."""
    plan = load_plan(plan_dir)
    print_summary(console, plan)
    return plan


# ------------------------------------------------------------------- report.md


def _model_name(plan: Plan) -> str:
    """``gpt2.py (preset=gpt2-xl)``: the model file's name and its arguments, for titles."""
    name = Path(str(plan.settings.model.model_file or "model")).name
    args = ", ".join(f"{k}={v}" for k, v in sorted((plan.settings.model.model_args or {}).items()))
    return f"{name} ({args})" if args else name


@dataclass(frozen=True)
class _AltRow:
    layout: str
    predicted: str
    why: str


def overlaps_line(lay: Layout) -> str:
    """One sentence naming the communication overlaps (and precision options) the prediction assumed."""
    names = ", ".join(f"--{o}" for o in lay.overlaps) or "none (every collective on the critical path)"
    extra = []
    if lay.cp > 1:
        extra.append(f"context parallel {lay.cp} (ring attention overlapped with attention)")
    if lay.fp8:
        extra.append("FP8 GEMMs")
    if lay.main_grads_dtype != "fp32":
        extra.append(f"{lay.main_grads_dtype} gradients")
    if lay.optimizer_state_dtype != "fp32":
        extra.append(f"{lay.optimizer_state_dtype} optimizer states")
    if lay.fp8_param_gather:
        extra.append("FP8 primary weights")
    if lay.ep_comm_overlap:
        extra.append("expert all-to-alls hidden behind another micro-batch's attention and experts (combined 1F1B)")
    return f"Overlaps assumed: {names}" + (f"; {', '.join(extra)}" if extra else "") + "."


def experts_line(plan: Plan) -> str | None:
    """One sentence on a mixture-of-experts plan: ep / etp, the expert-data-parallel group, and the expert
    parameters and state the most loaded GPU holds; None for a dense model."""
    ex = plan.assumptions.get("experts")
    if not ex:
        return None
    state = ex.get("bytes_per_gpu", {})
    total = sum(float(v) for v in state.values())
    parts = ", ".join(f"{k} {_gib(float(v))}" for k, v in state.items())
    return (
        f"Experts: {ex['num_experts']} per MoE layer in {ex['moe_pieces']} layers, split over ep {ex['ep']} x etp {ex['etp']} "
        f"(expert data parallel {ex['expert_data_parallel']}); a GPU holds up to {_count(ex['params_per_gpu'])} expert parameters, "
        f"{_gib(total)} GiB of expert state ({parts} GiB); token dispatch: {ex.get('dispatch', 'alltoall')}."
    )


def _report_context(plan: Plan, command: str) -> dict[str, Any]:
    lay, pr = plan.layout, plan.predicted
    world = lay.world
    info = SCHEDULE_INFO.get(lay.schedule)
    worst_stage = bottleneck_stage(plan)
    worst_rank = most_loaded_rank(plan)
    target = _target(plan)
    split = info is not None and info.split_backward
    stages = []
    for s in sorted(plan.stages, key=lambda s: s.index):
        m = s.memory_bytes
        stages.append(
            {
                "index": s.index,
                "rank": s.rank,
                "first": markdown_text(s.layers[0]),
                "last": markdown_text(s.layers[1]),
                "pieces": f"{s.pieces[0]}..{s.pieces[1] - 1}",
                "params": _count(s.params),
                "fwd": _ms(s.time_fwd_s),
                "bwd": _ms(s.time_bwd_s),
                "w": _ms(s.time_bwd_weight_s),
                "recompute": _ms(s.time_recompute_s),
                "send": _ms(s.send_fwd_s),
                "mem": _gib(m.get("total", 0)),
                "cap": _gib(s.capacity_bytes),
                "mark": " **bottleneck**" if s.index == worst_stage else "",
            }
        )
    ranks = []
    for b in memory_bars(plan):
        ranks.append(
            {
                "rank": b.rank,
                "stages": ", ".join(map(str, b.stages)),
                "comps": [_gib(b.components[c]) for c in COMPONENTS],
                "total": _gib(b.total),
                "cap": _gib(b.capacity),
                "pct": f"{b.total / b.capacity:.0%}" if b.capacity else "n/a",
                "mark": " **most loaded**" if b.rank == worst_rank else "",
            }
        )
    priced = [a for a in plan.alternatives if a.predicted is not None]
    rejected = [a for a in plan.alternatives if a.predicted is None]
    alt_rows = []
    for a in priced:
        assert a.predicted is not None
        diffs = layout_differences(a.layout, lay)
        alt_rows.append(
            _AltRow(
                code_span(a.layout.short()),
                f"{_ms(a.predicted.step_time_s)} ms ({_slower(a.predicted, pr)})",
                ("differs in " + ", ".join(diffs) + ". " if diffs else "") + compare_predicted(a.predicted, pr) + ".",
            )
        )
    rej_rows = [_AltRow(code_span(a.layout.short()), "rejected", markdown_text(a.rejected or "")) for a in rejected]
    if priced:
        best_alt = priced[0]
        assert best_alt.predicted is not None
        why = (
            f"It has the shortest predicted step of the {plan.assumptions.get('layouts_priced', len(priced) + 1)} layouts priced: "
            f"{_ms(pr.step_time_s)} ms against {_ms(best_alt.predicted.step_time_s)} ms ({_slower(best_alt.predicted, pr)}) for the "
            f"runner-up, {code_span(best_alt.layout.short())}"
            + (f", which differs in {', '.join(layout_differences(best_alt.layout, lay))}" if layout_differences(best_alt.layout, lay) else "")
            + "."
        )
    else:
        why = "It is the only layout that was priced: every other candidate was rejected (see below) or pinned out by the command."
    devices = []
    dtype = plan.model.get("dtype") or plan.settings.model.dtype or "bf16"
    for key, d in sorted(plan.assumptions.get("devices", {}).items()):
        peak = d.get("peak_flops", {})
        devices.append(
            {
                "key": code_span(key),
                "name": markdown_text(d.get("name", key)),
                "peak": f"{peak[dtype] / 1e12:,.0f}" if dtype in peak else "n/a",
                "memory": _gib(d.get("memory_bytes", 0)),
                "hbm": f"{d.get('memory_bandwidth', 0) / 1e9:,.0f}",
                "intra": f"{d.get('intra_bandwidth', 0) / 1e9:,.0f}",
                "inter": f"{d.get('inter_bandwidth', 0) / 1e9:,.1f}",
                "matmul_eff": f"{d.get('matmul_efficiency', 0):.2f}",
                "sustained": f"{d.get('sustained_matmul', 1.0):.2f}",
                "fp8_eff": f"{d['matmul_fp8_efficiency']:.3f}" if d.get("matmul_fp8_efficiency") else None,
                "memory_eff": f"{d.get('memory_efficiency', 0):.2f}",
                "sources": [(k, markdown_text(v)) for k, v in sorted(d.get("sources", {}).items())],
            }
        )
    overhead = plan.assumptions.get("runtime_overhead_bytes", {})
    src = list(plan.assumptions.get("time_sources", ["analytical"]))
    return {
        "command": command,
        "command_code": code_span(command),
        "model_file": code_span(plan.settings.model.model_file or "?"),
        "model_name": markdown_text(_model_name(plan)),
        "model_args": markdown_text(", ".join(f"{k}={v}" for k, v in sorted((plan.settings.model.model_args or {}).items())) or "none"),
        "sha256": code_span(plan.provenance.get("model_file_sha256", "")),
        "params": _count(plan.model.get("params", 0)),
        "seq_len": plan.model.get("seq_len"),
        "dtype": dtype,
        "cluster": markdown_text(plan.cluster.get("spec") or plan.settings.cluster.gpus),
        "cluster_notes": [markdown_text(n) for n in plan.cluster.get("notes", [])],
        "world": world,
        "lay": lay,
        "short": code_span(lay.short()),
        "overlaps": overlaps_line(lay),
        "experts": experts_line(plan),
        "schedule_description": info.description if info else lay.schedule,
        "pr": {
            "step": _ms(pr.step_time_s),
            "pipeline": _ms(pr.pipeline_time_s),
            "dp": _ms(pr.dp_comm_exposed_s),
            "opt": _ms(pr.optimizer_s),
            "tokens": f"{pr.tokens_per_s:,.0f}",
            "samples": f"{pr.samples_per_s:,.1f}",
            "tflops": f"{pr.tflops_per_gpu:.1f}",
            "mfu": f"{pr.mfu:.1%}",
            "bubble": f"{pr.bubble_fraction:.1%}",
            "peak": _gib(pr.peak_memory_bytes),
        },
        "why": why,
        "considered": plan.assumptions.get("layouts_considered", "?"),
        "priced": plan.assumptions.get("layouts_priced", "?"),
        "alt_rows": alt_rows,
        "rej_rows": rej_rows,
        "stages": stages,
        "split": split,
        "recompute": any(s.time_recompute_s > 0 for s in plan.stages),
        "ranks": ranks,
        "component_heads": ["weights", "grads", "optimizer", "activations", "buffers", "overhead"],
        "bottleneck": next(s for s in stages if s["index"] == worst_stage),
        "most_loaded": next(r for r in ranks if r["rank"] == worst_rank),
        "target": f"{target:.0%}",
        "devices": devices,
        "context_gib": f"{overhead.get('context', 0) / GiB:.2f}",
        "communicator_gib": f"{overhead.get('communicator', 0) / GiB:.2f}",
        "fragmentation": f"{float(plan.assumptions.get('fragmentation_reserve', 0)):.0%}",
        "optimizer": plan.assumptions.get("optimizer", plan.settings.memory.optimizer),
        "time_sources": src,
        "measured": "measured" in src,
        "all_measured": src == ["measured"],
        "profile": code_span(plan.settings.cluster.profile or "profile.json"),
        "notes": [markdown_text(n) for n in plan.notes],
    }


def report_markdown(plan: Plan, command: str) -> str:
    """report.md: the chosen layout and why, the stages, memory per GPU, the alternatives and the assumptions."""

    return render_template("report/report.md.j2", **_report_context(plan, command))


def report_files(plan: Plan, command: str) -> dict[str, str]:
    """The report files of a plan directory: {"report.md", "timeline.svg", "memory.svg"} -> text (deterministic)."""
    return {
        "report.md": report_markdown(plan, command),
        "timeline.svg": timeline_svg(plan, command),
        "memory.svg": memory_svg(plan, command),
    }
