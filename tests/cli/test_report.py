"""The report: terminal summary, report.md, timeline.svg and memory.svg, on real plans of all three engines."""

from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from planner import hardware
from planner.fileio import dumps_json
from planner.planning import plan_model
from planner.report import bottleneck_stage, explain, most_loaded_rank, print_summary, report_files, report_markdown
from planner.report_svg import COMPONENTS, KIND_COLOURS, memory_svg, simulate_plan, timeline_svg, timeline_view
from planner.solve.plan import Plan
from planner.solve.schedules import build_schedule
from planner.solve.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
SVG = "{http://www.w3.org/2000/svg}"
GiB = 2**30

REQUESTS = {
    "torch-zbv": dict(model_file="examples/gpt2.py", model_args={"preset": "gpt2-tiny"}, gpus="4xA100", engine="torch", schedule="zbv", pp=2),
    "torch-interleaved": dict(
        model_file="examples/gpt2.py", model_args={"preset": "gpt2-tiny"}, gpus="4xA100", engine="torch", schedule="interleaved", pp=2, vp=2
    ),
    "deepspeed-1f1b": dict(model_file="examples/gpt2.py", model_args={"preset": "gpt2-tiny"}, gpus="4xA100", engine="deepspeed", pp=2),
    "megatron-interleaved-recompute": dict(
        model_file="examples/llama.py",
        model_args={"preset": "llama-tiny", "n_layers": 8},
        gpus="8xA100",
        engine="megatron",
        pp=4,
        schedule="interleaved",
        vp=2,
        recompute="full",
        micro_batch=1,
    ),
}


@pytest.fixture(scope="module")
def planned() -> dict[str, tuple[Plan, object]]:
    """Plans as `planner plan` makes them, read back through plan.json's text (what `explain` sees), with the search result."""
    out = {}
    cwd = os.getcwd()
    os.chdir(ROOT)  # model paths relative to the repository, as a user types them
    try:
        for name, kw in REQUESTS.items():
            plan, _, result = plan_model(Settings.of(**kw))
            out[name] = (Plan.from_dict(json.loads(dumps_json(plan.to_dict()))), result)
    finally:
        os.chdir(cwd)
    return out


def _xml(text: str) -> ET.Element:
    return ET.fromstring(text.encode())


def _boxes(svg: str) -> list[tuple[int, str, float, float, float, float]]:
    """(rank, action, start ms, end ms, x, width) of every action box."""
    out = []
    for el in _xml(svg).iter(f"{SVG}rect"):
        if "data-action" in el.attrib:
            a = el.attrib
            out.append((int(a["data-rank"]), a["data-action"], float(a["data-start-ms"]), float(a["data-end-ms"]), float(a["x"]), float(a["width"])))
    return out


def _ir(plan: Plan, m: int | None = None) -> Counter:
    lay = plan.layout
    sched = build_schedule(lay.schedule, lay.pp, m or lay.num_microbatches, lay.vp)
    return Counter((r, str(a)) for r, acts in enumerate(sched.actions) for a in acts)


# ------------------------------------------------------------------ timeline.svg


@pytest.mark.parametrize("name", list(REQUESTS))
def test_timeline_one_box_per_action(planned, name):
    plan, _ = planned[name]
    svg = timeline_svg(plan, "planner plan x")
    boxes = _boxes(svg)
    assert Counter((r, a) for r, a, *_ in boxes) == _ir(plan), "every action of the schedule IR is drawn exactly once"
    # boxes sit where the simulator puts them, never overlap on a rank, and are as wide as they last
    sim = simulate_plan(plan)
    when = {(r, str(a)): (s * 1e3, e * 1e3) for r, a, s, e in sim.timeline}
    px_per_ms = float(next(g for g in _xml(svg).iter(f"{SVG}g") if "data-px-per-ms" in g.attrib).attrib["data-px-per-ms"])
    for r, a, s, e, x, w in boxes:
        assert when[(r, a)] == pytest.approx((s, e), rel=1e-6, abs=1e-9)
        assert w == pytest.approx((e - s) * px_per_ms, abs=0.02)
    for rank in range(plan.layout.pp):
        row = sorted((s, e) for r, _, s, e, *_ in boxes if r == rank)
        assert all(e0 <= s1 + 1e-6 for (_, e0), (s1, _) in zip(row, row[1:]))


@pytest.mark.parametrize("name", list(REQUESTS))
def test_timeline_reproduces_the_predicted_pipeline_time(planned, name):
    """The per-stage times read back from plan.json give the solver's own makespan (recompute counted once)."""
    plan, _ = planned[name]
    sim = simulate_plan(plan)
    assert sim.step_time == pytest.approx(plan.predicted.pipeline_time_s, rel=1e-4)
    assert sim.bubble_fraction == pytest.approx(plan.predicted.bubble_fraction, abs=1e-4)


def test_timeline_with_many_microbatches_draws_first_and_last_actions(planned):
    plan, _ = planned["megatron-interleaved-recompute"]
    lay = plan.layout
    big = replace(plan, layout=replace(lay, num_microbatches=512, global_batch=512 * lay.micro_batch * lay.dp))
    view = timeline_view(big)
    svg = timeline_svg(big)
    boxes = _boxes(svg)
    drawn = Counter((r, a) for r, a, *_ in boxes)
    ir = _ir(big)
    total = sum(ir.values())
    assert view.omitted > 0 and len(boxes) + view.omitted == total
    assert len(boxes) <= 2400
    assert max(drawn.values()) == 1 and not (drawn - ir), "only actions of the IR, each once"
    # per rank, what is drawn is the start and the end of its action list
    sched = build_schedule(lay.schedule, lay.pp, 512, lay.vp)
    for rank, acts in enumerate(sched.actions):
        names = [str(a) for a in acts]
        mine = {a for r, a in drawn if r == rank}
        head = next(i for i, a in enumerate(names) if a not in mine)
        tail = max(i for i, a in enumerate(names) if a not in mine)
        assert head > 0 and tail < len(names) - 1
        assert mine == set(names[:head]) | set(names[tail + 1 :])
    assert f"{view.omitted:,} steady-state actions" in svg
    assert f'data-omitted="{view.omitted}"' in svg


def test_timeline_marks_kinds_and_legend(planned):
    plan, _ = planned["torch-zbv"]
    svg = timeline_svg(plan)
    kinds = {re.sub(r"\d", "", a) for _, a, *_ in _boxes(svg)}
    assert kinds == {"F", "I", "W"}
    # first model chunk of each rank in the kind's colour, the later chunk lighter
    fills = {(el.attrib["data-action"], el.attrib["data-rank"]): el.attrib["fill"] for el in _xml(svg).iter(f"{SVG}rect") if "data-action" in el.attrib}
    p = plan.layout.pp
    for (action, rank), fill in fills.items():
        stage, kind = int(re.match(r"\d+", action).group()), re.sub(r"\d", "", action)
        assert (fill == KIND_COLOURS[kind]) == (stage == int(rank)), (action, rank, fill)  # V placement: rank r holds r and 2p-1-r
        assert stage in (int(rank), 2 * p - 1 - int(rank))
    for legend in ("forward", "backward (input grad)", "backward (weight grad)", "idle", "time (ms)"):
        assert legend in svg


# -------------------------------------------------------------------- memory.svg


@pytest.mark.parametrize("name", list(REQUESTS))
def test_memory_bars_add_up_to_the_plan(planned, name):
    plan, _ = planned[name]
    root = _xml(memory_svg(plan, "planner plan x"))
    plot = next(g for g in root.iter(f"{SVG}g") if g.attrib.get("data-plot") == "memory")
    px_per_gib = float(plot.attrib["data-px-per-gib"])
    base = float(plot.attrib["data-base-y"])
    bars = [g for g in plot.iter(f"{SVG}g") if "data-bar" in g.attrib]
    assert [int(g.attrib["data-rank"]) for g in bars] == list(range(plan.layout.pp))
    for g in bars:
        rank = int(g.attrib["data-rank"])
        want = next(r for r in plan.ranks if r.rank == rank)
        rects = list(g.iter(f"{SVG}rect"))
        comps = {r.attrib["data-component"]: int(r.attrib["data-bytes"]) for r in rects}
        assert set(comps) <= set(COMPONENTS)
        for c in COMPONENTS:
            assert comps.get(c, 0) == want.memory_bytes[c]
        assert int(g.attrib["data-total-bytes"]) == want.memory_bytes["total"]
        assert sum(comps.values()) == pytest.approx(want.memory_bytes["total"], abs=8)
        # the drawn heights add up to the total, stacked from the axis without gaps
        heights = sum(float(r.attrib["height"]) for r in rects)
        assert heights / px_per_gib == pytest.approx(want.memory_bytes["total"] / GiB, abs=0.02 * len(rects) / px_per_gib + 1e-3)
        lowest = max(float(r.attrib["y"]) + float(r.attrib["height"]) for r in rects)
        assert lowest == pytest.approx(base, abs=0.02)
        stages = [int(s) for s in g.attrib["data-stages"].split(",")]
        assert stages == [s.index for s in plan.stages if s.rank == rank]
    caps = [ln for ln in root.iter(f"{SVG}line") if ln.attrib.get("data-line") == "capacity"]
    targets = [ln for ln in root.iter(f"{SVG}line") if ln.attrib.get("data-line") == "target"]
    assert len(caps) == len(targets) == len(bars)
    cap = plan.ranks[0].capacity_bytes
    assert (base - float(caps[0].attrib["y1"])) / px_per_gib == pytest.approx(cap / GiB, abs=0.01)
    assert (base - float(targets[0].attrib["y1"])) / px_per_gib == pytest.approx(cap * plan.assumptions["mem_target"] / GiB, abs=0.01)


# ------------------------------------------------------------------ determinism


def test_report_files_are_deterministic(planned):
    plan, _ = planned["torch-interleaved"]
    cmd = "planner plan 'my model'\"'\"'s \"dir\"/$(touch x)/<&]]>--model.py' --gpus 4xA100"
    a = report_files(plan, cmd)
    again = Plan.from_dict(json.loads(dumps_json(plan.to_dict())))
    b = report_files(again, cmd)
    assert set(a) == {"report.md", "timeline.svg", "memory.svg"}
    assert a == b
    for text in a.values():
        assert "/work/" not in text and "/tmp/" not in text
    for name in ("timeline.svg", "memory.svg"):
        _xml(a[name])  # well-formed XML
        from planner import __version__

        desc = _xml(a[name]).find(f"{SVG}desc")
        assert desc is not None and desc.text == f"Generated by planner {__version__}: {cmd}"  # the exact command, escaped


# ------------------------------------------------------------------- report.md


@pytest.mark.parametrize("name", list(REQUESTS))
def test_report_md_names_every_stage_and_the_layout(planned, name):
    plan, _ = planned[name]
    cmd = "planner plan 'my model`s dir/model.py' --gpus 4xA100"
    md = report_markdown(plan, cmd)
    assert plan.layout.short() in md
    from planner import __version__

    assert f"planner {__version__}" in md and "``" in md  # a command with a backtick stays one code span
    stage_rows = [ln for ln in md.splitlines() if re.match(r"^\| \d+( \*\*bottleneck\*\*)? \| \d+ \| \d+\.\.\d+ \|", ln)]
    assert len(stage_rows) == len(plan.stages)
    for s, row in zip(sorted(plan.stages, key=lambda s: s.index), stage_rows):
        assert row.startswith(f"| {s.index}") and f"{s.layers[0]} .. {s.layers[1]}" in row
    assert f"| {bottleneck_stage(plan)} **bottleneck** |" in md
    assert f"| {most_loaded_rank(plan)} **most loaded** |" in md
    assert "**analytical**" in md and "timeline.svg" in md and "memory.svg" in md
    for dev in plan.assumptions["devices"].values():
        assert dev["name"] in md
        assert f"| sustained GEMM rate | {dev['sustained_matmul']:.2f} of those rates" in md  # A100: 0.95, not the short-loop rate alone
        assert "FP8 matmul efficiency" not in md  # no FP8 ceiling on an A100
    for alt in plan.alternatives:
        assert alt.layout.short() in md
        if alt.rejected:
            assert alt.rejected.replace("|", "\\|") in md


def test_report_md_gives_the_fp8_ceiling_and_sustained_rate_an_fp8_plan_is_priced_with():
    """An FP8 plan on H100: the device table shows the profile's FP8 ceiling (0.709, MAMF) and sustained rate (0.79)."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        plan, _, _ = plan_model(
            Settings.of(model_file="examples/gpt2.py", model_args={"preset": "gpt2-tiny"}, gpus="8xH100-SXM", engine="megatron", dtype="fp8")
        )
    finally:
        os.chdir(cwd)
    prof = hardware.load_profile(ROOT / "hardware_profiles" / "h100-sxm.yaml")
    md = report_markdown(plan, "planner plan examples/gpt2.py --gpus 8xH100-SXM --dtype fp8")
    assert f"| FP8 matmul efficiency | {prof.matmul_fp8_efficiency:.3f} of the FP8 peak" in md
    assert f"| sustained GEMM rate | {prof.sustained_matmul:.2f} of those rates" in md


# --------------------------------------------------------------- the terminal


@pytest.mark.parametrize("name", list(REQUESTS))
def test_print_summary_fits_100_columns_and_marks_the_bottleneck(planned, name):
    plan, result = planned[name]
    for res in (result, None):
        console = Console(record=True, width=100, color_system=None)
        print_summary(console, plan, res)
        text = console.export_text()
        assert plan.layout.short() in text
        assert max(len(line) for line in text.splitlines()) <= 100
        marked = [ln for ln in text.splitlines() if "◀ bottleneck" in ln]
        assert len(marked) == 1 and re.match(rf"\s*{bottleneck_stage(plan)}\s+\d+\s", marked[0])
        assert len([ln for ln in text.splitlines() if ln.rstrip().endswith("◀")]) == 1  # most loaded GPU
        assert "predicted step" in text and "MFU" in text and "bubble" in text and "exposed DP sync" in text
        for s in plan.stages:
            assert re.search(rf"^\s*{s.index}\s+{s.rank}\s", text, re.M), f"stage {s.index} row"
        if plan.layout.vp > 1:
            assert "stages" in text  # per-rank memory lists the stages each rank holds
        if res is not None:
            assert f"searched {res.considered} layouts" in text


def test_bottleneck_follows_the_stage_times(planned):
    plan, _ = planned["torch-interleaved"]
    slow = 1 if bottleneck_stage(plan) != 1 else 2
    most = max(s.time_fwd_s + s.time_bwd_s for s in plan.stages)
    stages = [replace(s, time_fwd_s=2 * most) if s.index == slow else s for s in plan.stages]
    changed = replace(plan, stages=stages)
    assert bottleneck_stage(changed) == slow
    console = Console(record=True, width=100, color_system=None)
    print_summary(console, changed)
    marked = [ln for ln in console.export_text().splitlines() if "◀ bottleneck" in ln]
    assert re.match(rf"\s*{slow}\s", marked[0])


def test_explain_reads_a_plan_directory(planned, tmp_path):
    plan, _ = planned["deepspeed-1f1b"]
    (tmp_path / "plan.json").write_text(dumps_json(plan.to_dict()))
    console = Console(record=True, width=100, color_system=None)
    got = explain(console, tmp_path)
    assert got.layout == plan.layout
    assert plan.layout.short() in console.export_text()


def test_timeline_with_many_ranks_draws_every_rank(planned):
    """48 pipeline ranks, 192 micro-batches: the picture is shortened, yet every rank shows its first and last actions."""
    plan, _ = planned["deepspeed-1f1b"]
    p = 48
    src = sorted(plan.stages, key=lambda s: s.index)
    stages = [replace(src[min(j, len(src) - 1)], index=j, rank=j) for j in range(p)]
    ranks = [replace(plan.ranks[min(j, len(plan.ranks) - 1)], rank=j) for j in range(p)]
    big = replace(plan, layout=replace(plan.layout, pp=p, dp=1, num_microbatches=192, global_batch=192 * plan.layout.micro_batch), stages=stages, ranks=ranks)
    view = timeline_view(big)
    assert view.omitted > 0
    sched = build_schedule("1f1b", p, 192)
    drawn = Counter((r, a) for r, a, *_ in _boxes(timeline_svg(big)))
    assert len(drawn) + view.omitted == sched.num_actions
    for rank, acts in enumerate(sched.actions):
        names = [str(a) for a in acts]
        assert all((rank, a) in drawn for a in names[:4] + names[-4:]), f"rank {rank}"
    bars = [g for g in _xml(memory_svg(big)).iter(f"{SVG}g") if "data-bar" in g.attrib]
    assert len(bars) == p


def test_memory_bar_text_shares_cells_by_size():
    from planner.report import memory_bar_text

    comps = {"weights": 0.9, "grads": 1.7, "optimizer": 2.6, "activations": 2.6, "buffers": 0.2, "overhead": 1.8}
    bar = memory_bar_text(comps, capacity=79.0, target=0.85).plain
    assert len(bar) == 20 and bar[17] == "|"
    assert bar[:2] == "oa" and set(bar[2:]) <= {"·", "|"}  # 9.8 of 79 = 2.48 cells: the two largest components
    full = memory_bar_text({"weights": 30, "optimizer": 50}, capacity=79.0, target=0.85).plain
    assert full == "w" * 8 + "o" * 12 + "!"  # over capacity: filled, and flagged


def test_timeline_of_a_huge_step_simulates_fewer_microbatches(planned, monkeypatch):
    import planner.report_svg as rs

    monkeypatch.setattr(rs, "MAX_SIMULATED", 4000)
    plan, _ = planned["megatron-interleaved-recompute"]
    lay = plan.layout
    huge = replace(plan, layout=replace(lay, num_microbatches=1024, global_batch=1024 * lay.micro_batch * lay.dp))
    view = rs.timeline_view(huge)
    assert view.m < 1024 and view.m % lay.pp == 0 and view.m_plan == 1024
    svg = rs.timeline_svg(huge)
    assert f"simulated with {view.m:,} of the plan's 1,024 micro-batches" in svg
    drawn = Counter((r, a) for r, a, *_ in _boxes(svg))
    assert not (drawn - _ir(huge, view.m)) and len(drawn) + view.omitted == sum(_ir(huge, view.m).values())
