"""The memory validation set (bench/memory_runs.py): its sources declare their split and metric, the bench model
file is Megatron's GPT in closed form, Megatron's even split is what megatron-core builds, and a measured peak of a
test source is predicted within 5% (the Megatron-LM functional test's pp 4 x vp 8 rows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bench import memory_runs

ROOT = Path(__file__).resolve().parents[2]


def test_sources_declare_split_and_metric_and_rows_are_enough():
    doc = yaml.safe_load(memory_runs.DATA.read_text())
    for name, src in doc["sources"].items():
        assert src["split"] in ("tune", "test") and src["metric"] in ("allocated", "reserved") and src["rank"] in ("last", "first", "max"), name
    rows = memory_runs.load()
    tune = {r.source for r in rows if r.split == "tune"}
    test = {r.source for r in rows if r.split == "test"}
    assert tune and test and not tune & test  # split by source
    assert len(rows) >= 12 and len(tune | test) >= 3


def test_bench_gpt_has_megatrons_parameter_count():
    """Megatron's GPT (learned positions, LayerNorm, GELU 4h, biases, GQA, untied): the closed-form count."""
    from planner.model.analyze import analyze

    L, h, heads, groups, s, V = 2, 256, 8, 2, 64, 1024
    kv = h // heads * groups
    per_layer = 2 * h + (h * (h + 2 * kv) + h + 2 * kv) + (h * h + h) + 2 * h + (h * 4 * h + 4 * h) + (4 * h * h + h)
    want = V * h + s * h + L * per_layer + 2 * h + V * h
    costs = analyze(
        ROOT / "bench/models/megatron_gpt.py", {"layers": L, "hidden": h, "heads": heads, "groups": groups, "seq_len": s, "vocab_size": V}, 1, "bf16"
    ).costs
    got = sum(l.params for l in costs.layers)  # untied: no parameter is counted twice
    assert got == want


def test_even_bounds_match_megatron_core():
    """Megatron's default split of 8 layers over pp 2 x vp 2 (planner.engines.megatron.layout.stage_layers, which
    mirrors megatron-core's get_num_layers_to_build): the layers of each stage; the embedding with the first, the
    output with the last."""
    from planner.engines.megatron.flags import Flag, MegatronArgs
    from planner.engines.megatron.layout import stage_layers
    from planner.model.analyze import analyze

    args = {"layers": 8, "hidden": 64, "heads": 4, "groups": 2, "seq_len": 16, "vocab_size": 128}
    costs = analyze(ROOT / "bench/models/megatron_gpt.py", args, 1, "bf16").costs
    bounds = memory_runs.even_bounds(costs, 2, 4)
    layers = [len({l.block for l in costs.layers[a:b] if l.block}) for a, b in zip(bounds, bounds[1:])]
    flags = (
        ("--num-layers", "8"),
        ("--hidden-size", "64"),
        ("--num-attention-heads", "4"),
        ("--pipeline-model-parallel-size", "2"),
        ("--num-virtual-stages-per-pipeline-rank", "2"),
    )
    megatron = stage_layers(MegatronArgs("args", tuple(Flag(n, (v,), k + 1) for k, (n, v) in enumerate(flags))))
    assert layers == megatron == [2, 2, 2, 2]
    assert costs.layers[0].block is None and costs.layers[-1].block is None  # embedding first, output last
    assert bounds[0] == 0 and bounds[-1] == costs.n


@pytest.mark.parametrize("name", ["M-7b-pp4-vp8-h100", "M-7b-pp4-vp8-a100"])
def test_megatron_functional_test_peak_within_5_percent(name):
    row = next(r for r in memory_runs.load() if r.name == name)
    got = memory_runs.predict(row)
    assert abs(got - row.measured_gib) / row.measured_gib < 0.05, (got, row.measured_gib)


@pytest.mark.parametrize("name", ["Z-6.2b-1f1b", "Z-28.3b-1f1b-i"])
def test_zero_bubble_pipeline_peak_within_10_percent(name):
    """Zero Bubble's Table 4 memory of Megatron's 1F1B and 1F1B-I (unfused attention, the first and last stages one
    layer fewer): the plan's allocated peak of the rank that peaks, within the issue's per-row bound."""
    row = next(r for r in memory_runs.load() if r.name == name)
    got = memory_runs.predict(row)
    assert abs(got - row.measured_gib) / row.measured_gib < 0.10, (got, row.measured_gib)
