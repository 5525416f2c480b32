"""Closed forms for the prediction features (overlaps, context parallelism, FP8, precision options, fixed costs),
the engines' rules for them, and Megatron's own validation of the flags they render."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest

from planner import hardware
from planner.engines import get_engine
from planner.engines.megatron.architecture import check_megatron_args
from planner.engines.megatron.render import render as render_megatron
from planner.engines.megatron.rules import bucket_params
from planner.engines.megatron.script import parse_megatron_args
from planner.errors import UsageError
from planner.model.analyze import analyze
from planner.records import ModelCosts
from planner.report import overlaps_line
from planner.solve.memory import FP8_WEIGHT_COPY_BYTES, fp8_amax_bytes, state_recipe
from planner.solve.plan import Layout, Plan
from planner.solve.search import (
    Context,
    enumerate_layouts,
    evaluate_layout,
    fp8_problems,
    memory_rejection,
    price_layout,
)
from planner.solve.settings import Settings
from planner.solve.timing import (
    kv_bytes,
    overlapped_collective_time,
    ring_attention_exposed,
    split_context,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "megatron"
ROOT = Path(__file__).resolve().parents[2]


def _lay(**kw) -> Layout:
    base = Layout("megatron", 2, 8, 4, 1, 1, 8, 32, "1f1b", "selective", 1, True)
    return replace(base, **kw)


# --------------------------------------------------------------------------- memory closed forms


@pytest.mark.parametrize("d", [1, 4, 8, 64])
def test_megatron_precision_options_bytes_per_parameter(d):
    meg = get_engine("megatron")
    per = lambda lay: sum(meg.state_recipe("bf16", lay.zero, "adam", lay).per_param(d))
    assert per(_lay(zero=0)) == pytest.approx(18)  # 2 bf16 + 4 fp32 main grad + 12 (master + m + v)
    assert per(_lay()) == pytest.approx(6 + 12 / d)  # distributed optimizer
    # the precision-aware optimizer: bf16 moments, and the fp32 master kept as its 16-bit remainders (2 bytes)
    assert per(_lay(optimizer_state_dtype="bf16")) == pytest.approx(6 + (2 + 2 + 2) / d)
    assert per(_lay(optimizer_state_dtype="bf16", main_grads_dtype="bf16")) == pytest.approx(4 + 6 / d)
    assert per(_lay(main_grads_dtype="bf16", zero=0)) == pytest.approx(2 + 2 + 12)
    assert per(_lay(fp8=True)) == pytest.approx(6 + 12 / d)  # bf16 weights; the FP8 GEMM weights' copies come on top:
    assert meg.state_recipe("bf16", 1, "adam", _lay(fp8=True)).fp8_gemm_bytes == FP8_WEIGHT_COPY_BYTES  # FP8 copy + transpose


def test_state_dtype_scales_only_the_moments():
    assert sum(state_recipe("bf16", "adam", state_dtype="fp16").per_param(1)) == pytest.approx(2 + 2 + 4 + 4)
    assert sum(state_recipe("bf16", "sgd", state_dtype="bf16").per_param(1)) == pytest.approx(2 + 2 + 4 + 2)
    with pytest.raises(ValueError):
        state_recipe("bf16", "adam", state_dtype="int4")


def test_fp8_amax_history_bytes():
    # 4 GEMMs x 5 FP8 tensors x (history + scale + scale_inv) fp32 values per layer
    assert fp8_amax_bytes(1, 1024) == 4 * 5 * 1026 * 4
    assert fp8_amax_bytes(12, 1) == 12 * 4 * 5 * 3 * 4


# --------------------------------------------------------------------------- time closed forms


def test_tp_overlap_hides_all_but_one_chunk():
    assert overlapped_collective_time(8.0, 100.0, 8) == pytest.approx(1.0)  # long GEMMs: one chunk of 8 exposed
    assert overlapped_collective_time(8.0, 2.0, 8) == pytest.approx(6.0)  # short GEMMs: what they cannot cover
    assert overlapped_collective_time(8.0, 2.0, 1) == 8.0
    assert overlapped_collective_time(0.0, 2.0, 8) == 0.0


def test_ring_attention_exposure():
    # cp = 4, core 4 s -> 1 s per block step; a transfer of 1.5 s exposes 0.5 s on each of 3 steps forward,
    # backward 2 x 1.5 against 2 x 1 -> 1 s on each of 3 steps
    assert ring_attention_exposed(1.5, 4.0, 4) == pytest.approx((1.5, 3.0))
    assert ring_attention_exposed(0.5, 4.0, 4) == (0.0, 0.0)
    assert ring_attention_exposed(9.0, 4.0, 1) == (0.0, 0.0)


def test_dp_overlap_bucket_floor_and_param_gather():
    assert bucket_params(8) == 40_000_000 and bucket_params(128) == 128_000_000
    meg = get_engine("megatron")
    prm = 4e8  # 40M buckets: 10% of the exchange is the last bucket
    lay = _lay(overlap_grad_reduce=True, overlap_param_gather=True)
    assert meg.exposed_dp_time(lay, 1.0, 1.0, [5.0], [5.0], prm) == pytest.approx(0.2)
    assert meg.exposed_dp_time(replace(lay, overlap_param_gather=False), 1.0, 1.0, [5.0], [5.0], prm) == pytest.approx(1.1)
    # without the overlap the all-gather is not hidden by the backward (the old model hid it there)
    assert meg.exposed_dp_time(_lay(), 1.0, 1.0, [5.0], [5.0], prm) == 2.0


# --------------------------------------------------------------------------- context parallelism


@pytest.fixture(scope="module")
def gpt_costs() -> ModelCosts:
    from planner.model.analyze import analyze

    return analyze(ROOT / "examples" / "gpt2.py", {"preset": "gpt2-medium"}, 1, "bf16").costs


def test_split_context_divides_tokens_not_parameters(gpt_costs):
    c2 = split_context(gpt_costs, 2)
    for a, b in zip(gpt_costs.layers, c2.layers):
        assert b.params == a.params
        assert b.flops_fwd == pytest.approx(a.flops_fwd / 2)
        assert b.saved_bytes == pytest.approx(a.saved_bytes / 2, abs=1)
    assert c2.cuts[1].bytes == pytest.approx(gpt_costs.cuts[1].bytes / 2, abs=1)
    arch = gpt_costs.architecture
    assert kv_bytes(gpt_costs, 1, 2) == 2 * gpt_costs.seq_len / 2 * 1 * arch["hidden_size"] * 2


def test_cp_rules_per_engine(gpt_costs):
    lay = Layout("megatron", 1, 1, 2, 1, 1, 4, 8, "1f1b", "none", 0, False, cp=2)
    assert get_engine("megatron").layout_problems(lay, gpt_costs) == []
    odd = replace(gpt_costs, seq_len=1026)
    assert any("2 x cp" in p for p in get_engine("megatron").layout_problems(replace(lay, cp=4), odd))
    assert any("context parallelism" in p for p in get_engine("deepspeed").layout_problems(replace(lay, engine="deepspeed"), gpt_costs))


def test_cp_halves_activations_and_plans(gpt_costs):
    cluster = hardware.parse_gpus("8xH100-SXM")
    opts = Settings.of(engine="megatron", global_batch=16, mem_target=1.0)
    ctx = Context(gpt_costs, cluster, opts, get_engine("megatron"))
    one = evaluate_layout(ctx, Layout("megatron", 2, 2, 2, 1, 1, 8, 16, "1f1b", "none", 0, True), "bf16")
    two = evaluate_layout(ctx, Layout("megatron", 2, 2, 1, 1, 1, 16, 16, "1f1b", "none", 0, True, cp=2), "bf16")
    assert sum(two.act_per_mb) == pytest.approx(sum(one.act_per_mb) / 2, rel=1e-3)  # per micro-batch, whole model
    assert two.layout.world == 8


def test_feature_rules(gpt_costs):
    meg = get_engine("megatron")
    assert any("--sequence-parallel" in p for p in meg.layout_problems(_lay(tp=1, sequence_parallel=False, tp_comm_overlap=True), gpt_costs))
    assert any("distributed optimizer" in p for p in meg.layout_problems(_lay(zero=0, overlap_param_gather=True), gpt_costs))
    assert any("precision-aware" in p for p in meg.layout_problems(_lay(zero=0, optimizer_state_dtype="bf16"), gpt_costs))
    ds = Layout("deepspeed", 2, 1, 4, 1, 1, 8, 32, "1f1b", "none", 1)
    assert any("FP8" in p for p in get_engine("deepspeed").layout_problems(replace(ds, fp8=True), gpt_costs))
    assert any("overlap" in p for p in get_engine("torch").layout_problems(replace(ds, engine="torch", zero=0, overlap_grad_reduce=True), gpt_costs))


def test_search_defaults_and_searches_overlaps(gpt_costs):
    cluster = hardware.parse_gpus("16xH100-SXM")
    opts = Settings.of(engine="megatron", global_batch=64, tp=4, pp=2, zero=1, micro_batch=1, recompute="none", schedule="1f1b")
    lays, _ = enumerate_layouts(gpt_costs, cluster, opts, get_engine("megatron"), 64)
    assert {l.tp_comm_overlap for l in lays} == {False, True}
    assert all(l.overlap_grad_reduce and l.overlap_param_gather for l in lays)
    ds, _ = enumerate_layouts(gpt_costs, cluster, Settings.of(engine="deepspeed", global_batch=64), get_engine("deepspeed"), 64)
    assert not any(l.overlaps for l in ds)


def test_tp_comm_overlap_is_faster_and_costs_buffers(gpt_costs):
    cluster = hardware.parse_gpus("8xH100-SXM")
    ctx = Context(gpt_costs, cluster, Settings.of(engine="megatron", global_batch=8, mem_target=1.0), get_engine("megatron"))
    lay = Layout("megatron", 1, 8, 1, 1, 1, 8, 8, "1f1b", "none", 0, True)
    off, on = evaluate_layout(ctx, lay, "bf16"), evaluate_layout(ctx, replace(lay, tp_comm_overlap=True), "bf16")
    assert on.predicted.step_time_s < off.predicted.step_time_s
    a = gpt_costs.architecture
    extra = 10 * gpt_costs.seq_len * a["hidden_size"] * 2
    assert on.rank_memory[0]["overhead"] - off.rank_memory[0]["overhead"] == pytest.approx(extra, rel=1e-6)


# --------------------------------------------------------------------------- FP8


def test_fp8_refused_without_fp8_tensor_cores():
    with pytest.raises(UsageError, match="FP8 tensor cores"):
        fp8_problems(hardware.parse_gpus("8xA100-80GB"))
    for dev in ("H100-SXM", "H200", "B200"):
        fp8_problems(hardware.parse_gpus(f"8x{dev}"))


def test_fp8_gemms_run_at_the_fp8_peak(gpt_costs):
    cluster = hardware.parse_gpus("8xH100-SXM")
    ctx = Context(gpt_costs, cluster, Settings.of(engine="megatron", global_batch=8, mem_target=1.0), get_engine("megatron"))
    bf = ctx.times(8, 1, "none", 0, "bf16")
    f8 = ctx.times(8, 1, "none", 0, "bf16", fp8=True)
    assert sum(f8.fwd) < sum(bf.fwd)
    lay = Layout("megatron", 1, 1, 8, 1, 1, 1, 8, "1f1b", "none", 1, False)
    a, b = evaluate_layout(ctx, lay, "bf16"), evaluate_layout(ctx, replace(lay, fp8=True), "bf16")
    blocks, h = gpt_costs.architecture["num_layers"], gpt_costs.architecture["hidden_size"]
    diff = b.rank_memory[0]["weights"] - a.rank_memory[0]["weights"]
    # copies of the blocks' weights only (QKV 3h^2 + 3h, projection h^2 + h, FC1 4h^2 + 4h, FC2 4h^2 + h, two LayerNorms
    # 2 x 2h per layer); the embeddings and the output layer are Megatron's own bf16 layers
    assert diff == pytest.approx(FP8_WEIGHT_COPY_BYTES * blocks * (12 * h * h + 13 * h), rel=1e-9)
    assert b.rank_memory[0]["buffers"] - a.rank_memory[0]["buffers"] == pytest.approx(0.0, abs=1.0)
    # the amax history is a fixed reserve; the fragmentation reserve follows the (smaller, 1-byte) saved GEMM inputs only
    transient = {k: b.rank_memory[0][k] - a.rank_memory[0][k] for k in ("activations", "buffers")}
    assert transient["activations"] < 0
    frag = ctx.opts.knobs.overhead.fragmentation
    assert b.rank_memory[0]["overhead"] - a.rank_memory[0]["overhead"] == pytest.approx(fp8_amax_bytes(blocks, 1024) + frag * sum(transient.values()), rel=1e-9)


# --------------------------------------------------------------------------- interleaved memory: one answer per rank


def test_interleaved_fit_check_is_the_simulated_rank_peak(gpt_costs):
    cluster = hardware.parse_gpus("8xH100-SXM")
    lay = Layout("megatron", 4, 1, 2, 2, 4, 8, 64, "interleaved", "none", 0, False)
    loose = Context(gpt_costs, cluster, Settings.of(engine="megatron", global_batch=64, mem_target=1.0), get_engine("megatron"))
    ev = price_layout(loose, lay, "bf16")
    peak = max(r["total"] for r in ev.rank_memory)
    stage_sum = max(sum(s["total"] for j, s in enumerate(ev.stage_memory) if ev.stage_rank[j] == r) for r in range(lay.pp))
    assert stage_sum > peak  # summing each virtual stage's held micro-batches overstates the rank
    cap = ev.capacity[0]
    target = (peak + stage_sum) / 2 / cap  # between the two: the rank fits
    assert memory_rejection(ev, target) is None
    ctx = Context(gpt_costs, cluster, Settings.of(engine="megatron", global_batch=64, mem_target=target), get_engine("megatron"))
    fit = evaluate_layout(ctx, lay, "bf16")
    assert not hasattr(fit, "reason"), fit
    assert max(r["total"] for r in fit.rank_memory) <= cap * target
    assert fit.predicted.peak_memory_bytes == int(max(r["total"] for r in fit.rank_memory))


# --------------------------------------------------------------------------- rendering, checked by Megatron


def _plan(name: str, **layout) -> Plan:
    d = json.loads((FIXTURES / f"{name}.json").read_text())
    d = copy.deepcopy(d)
    d["layout"].update(layout)
    return Plan.from_dict(d)


@pytest.mark.parametrize(
    "changes",
    [
        {"cp": 2, "dp": 4, "num_microbatches": 16},
        {"tp_comm_overlap": True},
        {"zero": 1, "overlap_grad_reduce": True, "overlap_param_gather": True},
        {"zero": 1, "optimizer_state_dtype": "bf16", "main_grads_dtype": "bf16"},
        {"main_grads_dtype": "bf16"},
        {"fp8": True},
    ],
    ids=["cp2", "tp-overlap", "dp-overlaps", "precision-aware", "grad-reduce-bf16", "fp8"],
)
def test_rendered_feature_flags_pass_megatron_validation(changes):
    from planner.engines.megatron.core_check import core_config

    base = _plan("llama7b")
    plan = _plan("llama7b", **changes)
    if "cp" in changes:  # the same GPUs: cp takes the place of dp
        assert plan.layout.world == base.layout.world
    args = parse_megatron_args(render_megatron(plan, "planner plan", None)["pretrain_gpt.sh"])
    assert check_megatron_args(args, plan.layout.world) == []
    lay = plan.layout
    assert args.int("--context-parallel-size", 1) == lay.cp
    assert args.has("--tp-comm-overlap") == lay.tp_comm_overlap
    assert args.has("--overlap-grad-reduce") == lay.overlap_grad_reduce
    assert args.has("--overlap-param-gather") == lay.overlap_param_gather
    if lay.fp8:
        assert args.value("--fp8-format") == "hybrid" and args.value("--fp8-recipe") == "delayed"
    if lay.optimizer_state_dtype != "fp32":
        assert args.has("--use-precision-aware-optimizer") and args.value("--exp-avg-dtype") == "bf16"
    cfg = core_config(args)  # megatron-core's TransformerConfig accepts the parallel sizes
    assert cfg.context_parallel_size == lay.cp
    from megatron.core.transformer import TransformerConfig

    if lay.fp8 or lay.tp_comm_overlap:
        # TransformerConfig takes the FP8 recipe and the TP overlap as Megatron-LM passes them
        fp8 = replace(
            cfg,
            fp8=args.value("--fp8-format"),
            fp8_recipe=args.value("--fp8-recipe"),
            fp8_amax_history_len=args.int("--fp8-amax-history-len", 1),
            fp8_amax_compute_algo=args.value("--fp8-amax-compute-algo") or "most_recent",
            tp_comm_overlap=args.has("--tp-comm-overlap"),
        )
        assert isinstance(fp8, TransformerConfig)


def test_megatron_flags_refuse_overlap_param_gather_without_distributed_optimizer():
    plan = _plan("llama7b", zero=0, overlap_grad_reduce=True, overlap_param_gather=True)
    with pytest.raises(UsageError, match="overlap-param-gather"):
        render_megatron(plan, "planner plan", None)


def test_overlaps_line():
    assert overlaps_line(_lay()) == "Overlaps assumed: none (every collective on the critical path)."
    line = overlaps_line(_lay(tp_comm_overlap=True, overlap_grad_reduce=True, cp=2, fp8=True))
    assert "--tp-comm-overlap" in line and "--overlap-grad-reduce" in line and "context parallel 2" in line and "FP8" in line


def test_old_megatron_plans_keep_their_rendered_grad_overlap():
    d = json.loads((FIXTURES / "llama7b.json").read_text())
    for k in ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "cp"):
        d["layout"].pop(k, None)
    lay = Plan.from_dict(d).layout
    assert lay.overlap_grad_reduce == (lay.dp > 1 or lay.zero >= 1) and lay.cp == 1


def test_cli_fp8_and_cp_refusals_exit_2(gpt_costs):
    cluster = hardware.parse_gpus("8xH100-SXM")
    with pytest.raises(UsageError, match="no FP8 training"):
        enumerate_layouts(gpt_costs, cluster, Settings.of(engine="deepspeed", fp8=True), get_engine("deepspeed"), 64)
    with pytest.raises(UsageError, match="context parallelism"):
        enumerate_layouts(gpt_costs, cluster, Settings.of(engine="torch", cp=2), get_engine("torch"), 64)
    with pytest.raises(UsageError, match="--cp must be at least 1"):
        enumerate_layouts(gpt_costs, cluster, Settings.of(engine="megatron", cp=0), get_engine("megatron"), 64)


def test_gpt3_175b_interleaved_on_128_h100_fits_at_its_simulated_peak():
    """The issue's case: each virtual stage's held micro-batches summed gave 83.2 GiB and refused the layout; the
    simulated per-rank peak (what plan.json reports) is 76.1 GiB of 79.0, and that is the answer the fit check uses."""
    costs = analyze(ROOT / "examples" / "gpt2.py", {"preset": "gpt3-175b", "attention": "explicit"}, 1, "fp16").costs
    cluster = hardware.parse_gpus("128xH100-SXM")
    lay = Layout("megatron", 8, 4, 4, 6, 1, 64, 256, "interleaved", "selective", 1, True)
    ctx = Context(costs, cluster, Settings.of(engine="megatron", global_batch=256, mem_target=1.0), get_engine("megatron"))
    ev = evaluate_layout(ctx, lay, costs.dtype)
    assert not hasattr(ev, "reason"), ev.reason
    peak = max(r["total"] for r in ev.rank_memory)
    assert peak <= ev.capacity[0] and ev.predicted.peak_memory_bytes == int(peak)
    stage_sum = max(sum(s["total"] for j, s in enumerate(ev.stage_memory) if ev.stage_rank[j] == r) for r in range(lay.pp))
    assert stage_sum > ev.capacity[0]  # the old per-stage sum would have refused it


def test_megatron_step_zeroes_the_whole_gradient_buffer(gpt_costs):
    """Megatron's train_step zeroes every local gradient (zero_grad_buffer -> grad_data.zero_()) once per step, before the
    first forward: a write of all the GPU's parameters x the main-gradient bytes, added to the optimizer step (Adam over
    the 1/dp shard, 30 bytes per parameter), both at the H100's 3350 GB/s x 0.8."""
    cluster = hardware.parse_gpus("8xH100-SXM")
    meg = get_engine("megatron")
    lay = Layout("megatron", 1, 2, 4, 1, 1, 4, 16, "1f1b", "none", 1, True)  # tp 2, dp 4, distributed optimizer
    hbm = 3350e9 * 0.8

    def optimizer_s(engine, layout):
        ctx = Context(gpt_costs, cluster, Settings.of(engine="megatron", global_batch=16, mem_target=100.0), engine)
        ev = evaluate_layout(ctx, layout, "bf16")
        return ev.predicted.optimizer_s, sum(ev.stage_params)

    t, p = optimizer_s(meg, lay)  # p: parameters on one GPU (1/tp of the sharded weights)
    assert t == pytest.approx((p / 4 * 30 + p * 4) / hbm)  # fp32 main gradients: 4 bytes each
    t16, _ = optimizer_s(meg, replace(lay, main_grads_dtype="bf16"))
    assert t16 == pytest.approx((p / 4 * 30 + p * 2) / hbm)
    other = copy.copy(meg)
    other.zeroes_grad_buffer = False  # an engine without such a buffer (torch sets gradients to None): Adam alone
    t0, _ = optimizer_s(other, lay)
    assert t0 == pytest.approx(p / 4 * 30 / hbm)
    assert not get_engine("torch").zeroes_grad_buffer and not get_engine("deepspeed").zeroes_grad_buffer
