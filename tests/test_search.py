"""Layout search and memory model: engine rules, pins, pruning, closed forms, published runs."""

import math
import pickle
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from planner import hardware
from planner.engines import get_engine
from planner.errors import InfeasibleError, UsageError
from planner.model.analyze import analyze
from planner.planning import PlanRequest, plan_model
from planner.solve import partition as part
from planner.solve.memory import GiB, StateRecipe, activation_bytes_per_microbatch, state_recipe
from planner.solve.plan import Layout
from planner.solve.search import Context, Rejection, SearchOptions, evaluate_layout, search

ROOT = Path(__file__).resolve().parent.parent
EX = ROOT / "examples"


# ----------------------------------------------------------------- model state per parameter (closed forms)


def test_state_recipes_match_published_bytes_per_parameter():
    # Rajbhandari et al. 2019: mixed-precision Adam 16 B/param; ZeRO-1 4 + 12/d
    assert sum(state_recipe("bf16", "adam").per_param(1)) == 16
    assert sum(state_recipe("bf16", "adam", zero=1).per_param(8)) == pytest.approx(4 + 12 / 8)
    # Megatron (theoretical_memory_usage.py): 18 B/param, 6 + 12/d with the distributed optimizer
    assert sum(get_engine("megatron").state_recipe("bf16", zero=0).per_param(4)) == 18
    assert sum(get_engine("megatron").state_recipe("bf16", zero=1).per_param(4)) == pytest.approx(6 + 12 / 4)
    # DeepSpeed bf16 runs BF16_Optimizer: master + moments over dp; fp32 gradient accumulation at ZeRO-1
    assert sum(get_engine("deepspeed").state_recipe("bf16", zero=1).per_param(4)) == pytest.approx(2 + 4 + 12 / 4)
    assert sum(state_recipe("fp32", "sgd").per_param(1)) == 12


# ----------------------------------------------------------------- engine rules and pins


def test_deepspeed_layouts_never_use_zero2_or_interleaving(llama7b):
    cl = hardware.parse_gpus("16xA100")
    res = search(llama7b, cl, SearchOptions(engine="deepspeed"), get_engine("deepspeed"))
    assert res.best is not None
    for e in res.ranked:
        assert e.layout.schedule == "1f1b" and e.layout.vp == 1 and e.layout.zero <= 1 and e.layout.tp == 1
    ctx = Context(llama7b, cl, SearchOptions(engine="deepspeed"), get_engine("deepspeed"))
    bad = Layout("deepspeed", 2, 1, 8, 1, 1, 8, 64, "1f1b", "none", 2)
    rej = evaluate_layout(ctx, bad, "bf16")
    assert isinstance(rej, Rejection) and "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" in rej.reason


def test_megatron_cuts_only_between_whole_layers(llama7b):
    allowed = get_engine("megatron").allowed_cuts(llama7b)
    names = [l.name for l in llama7b.layers]
    for k in range(1, llama7b.n):
        if allowed[k]:
            assert names[k].endswith(":attention"), names[k]  # a layer starts here
    assert not allowed[1]  # the embedding stays with the first layer
    assert not allowed[llama7b.n - 2] and not allowed[llama7b.n - 1]  # norm and head stay with the last layer
    res = search(llama7b, hardware.parse_gpus("16xA100"), SearchOptions(engine="megatron", pp=4, tp=2), get_engine("megatron"))
    for e in res.ranked:
        assert all(allowed[b] for b in e.bounds)


def test_pins_fix_the_layout(llama7b):
    cl = hardware.parse_gpus("16xA100")
    opts = SearchOptions(engine="torch", pp=4, dp=4, micro_batch=1, schedule="zbv", recompute="full", global_batch=64)
    res = search(llama7b, cl, opts, get_engine("torch"))
    assert res.ranked and all(
        (e.layout.pp, e.layout.dp, e.layout.micro_batch, e.layout.schedule, e.layout.vp, e.layout.recompute) == (4, 4, 1, "zbv", 2, "full")
        for e in res.ranked
    )
    assert res.best.layout.num_microbatches == 64 // (4 * 1)


def test_impossible_pins_are_a_usage_error(llama7b):
    with pytest.raises(UsageError, match="not divisible by pp x tp = 3"):
        search(llama7b, hardware.parse_gpus("8xA100"), SearchOptions(engine="megatron", pp=3, tp=1), get_engine("megatron"))


def test_pruned_search_finds_the_exhaustive_best(gpt2xl):
    cl = hardware.parse_gpus("16xA100-40GB")
    fast = search(gpt2xl, cl, SearchOptions(engine="torch", top_k=3), get_engine("torch"))
    full = search(gpt2xl, cl, SearchOptions(engine="torch", top_k=3, exhaustive=True), get_engine("torch"))
    assert full.priced > fast.priced
    assert [e.layout for e in fast.ranked[:3]] == [e.layout for e in full.ranked[:3]]
    assert fast.best.predicted.step_time_s == full.best.predicted.step_time_s


# ----------------------------------------------------------------- memory model against closed forms


def test_1f1b_first_stage_holds_p_microbatches_of_activations(gpt2xl):
    """1F1B: stage i holds min(m, p - i) micro-batches, so stage 0's activations = p x its micro-batch bytes."""
    cl = hardware.parse_gpus("8xA100")
    ctx = Context(gpt2xl, cl, SearchOptions(engine="deepspeed", mem_target=1.0), get_engine("deepspeed"))
    lay = Layout("deepspeed", 8, 1, 1, 1, 1, 32, 32, "1f1b", "none", 1)
    ev = evaluate_layout(ctx, lay, "bf16")
    assert not isinstance(ev, Rejection)
    for j, (a, b) in enumerate(zip(ev.bounds, ev.bounds[1:])):
        per_mb = activation_bytes_per_microbatch(gpt2xl, a, b, "none")
        assert ev.rank_memory[j]["activations"] == pytest.approx(min(32, 8 - j) * per_mb)


def test_gpipe_holds_every_microbatch(gpt2xl):
    cl = hardware.parse_gpus("4xA100")
    ctx = Context(gpt2xl, cl, SearchOptions(engine="torch", mem_target=1.0), get_engine("torch"))
    lay = Layout("torch", 4, 1, 1, 1, 1, 6, 6, "gpipe", "full", 0)
    ev = evaluate_layout(ctx, lay, "bf16")
    for j, (a, b) in enumerate(zip(ev.bounds, ev.bounds[1:])):
        assert ev.rank_memory[j]["activations"] == pytest.approx(6 * activation_bytes_per_microbatch(gpt2xl, a, b, "full"))


def test_full_recompute_keeps_only_block_inputs(llama7b):
    a, b = 1, 1 + 2 * 4  # four whole layers
    kept = activation_bytes_per_microbatch(llama7b, a, b, "full")
    assert kept == 4 * 4096 * 4096 * 2  # one (s, h) bf16 input per layer
    assert activation_bytes_per_microbatch(llama7b, a, b, "none") > 20 * kept


def test_stage_memory_components_add_up(llama7b):
    cl = hardware.parse_gpus("16xA100")
    res = search(llama7b, cl, SearchOptions(engine="megatron"), get_engine("megatron"))
    for rm in res.best.rank_memory:
        parts = sum(v for k, v in rm.items() if k != "total")
        assert rm["total"] == pytest.approx(parts)
        assert rm["total"] <= 0.85 * cl.device_of(0).memory_bytes


# ----------------------------------------------------------------- nothing fits


def test_nothing_fits_names_the_smallest_change():
    req = PlanRequest(model_file=str(EX / "llama.py"), model_args={"preset": "llama-70b"}, gpus="8xA100", engine="deepspeed")
    with pytest.raises(InfeasibleError) as e:
        plan_model(req)
    assert e.value.exit_code == 1
    text = str(e.value)
    assert "fits on" in text or "fit" in text
    assert "GiB" in text
    assert "would fit" in text  # a concrete suggestion: more GPUs
