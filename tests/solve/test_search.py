"""Layout search and memory model: engine rules, pins, pruning, closed forms, published runs."""

import re
from pathlib import Path

import numpy as np
import pytest

from planner import hardware
from planner.engines import get_engine
from planner.errors import InfeasibleError, UsageError
from planner.planning import plan_model
from planner.solve.memory import activation_bytes_per_microbatch, state_recipe
from planner.solve.plan import Layout
from planner.solve.rules import RejectKind
from planner.solve.search import Context, Rejection, _needs_no_less_memory, enumerate_layouts, evaluate_layout, search
from planner.solve.settings import Settings
from planner.solve.timing import analytical_times

ROOT = Path(__file__).resolve().parents[2]
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
    res = search(llama7b, cl, Settings.of(engine="deepspeed"), get_engine("deepspeed"))
    assert res.best is not None
    for e in res.ranked:
        assert e.layout.schedule == "1f1b" and e.layout.vp == 1 and e.layout.zero <= 1 and e.layout.tp == 1
    ctx = Context(llama7b, cl, Settings.of(engine="deepspeed"), get_engine("deepspeed"))
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
    res = search(llama7b, hardware.parse_gpus("16xA100"), Settings.of(engine="megatron", pp=4, tp=2), get_engine("megatron"))
    for e in res.ranked:
        assert all(allowed[b] for b in e.bounds)


def test_pins_fix_the_layout(llama7b):
    cl = hardware.parse_gpus("16xA100")
    opts = Settings.of(engine="torch", pp=4, dp=4, micro_batch=1, schedule="zbv", recompute="full", global_batch=64)
    res = search(llama7b, cl, opts, get_engine("torch"))
    assert res.ranked and all(
        (e.layout.pp, e.layout.dp, e.layout.micro_batch, e.layout.schedule, e.layout.vp, e.layout.recompute) == (4, 4, 1, "zbv", 2, "full") for e in res.ranked
    )
    assert res.best.layout.num_microbatches == 64 // (4 * 1)


def test_impossible_pins_are_a_usage_error(llama7b):
    with pytest.raises(UsageError, match="not divisible by pp x tp = 3"):
        search(llama7b, hardware.parse_gpus("8xA100"), Settings.of(engine="megatron", pp=3, tp=1), get_engine("megatron"))
    with pytest.raises(UsageError, match=r"global batch 64, cp=3: 8 is not divisible by cp = 3\."):
        search(llama7b, hardware.parse_gpus("8xA100"), Settings.of(engine="megatron", cp=3), get_engine("megatron"))
    with pytest.raises(UsageError, match=r"pp=2, tp=2, dp=3: 8 is not divisible by pp x tp x dp = 12\."):
        search(llama7b, hardware.parse_gpus("8xA100"), Settings.of(engine="megatron", pp=2, tp=2, dp=3), get_engine("megatron"))


def test_pruned_search_finds_the_exhaustive_best(gpt2xl):
    cl = hardware.parse_gpus("16xA100-40GB")
    fast = search(gpt2xl, cl, Settings.of(engine="torch", top_k=3), get_engine("torch"))
    full = search(gpt2xl, cl, Settings.of(engine="torch", top_k=3, exhaustive=True), get_engine("torch"))
    assert full.priced > fast.priced
    assert [e.layout for e in fast.ranked[:3]] == [e.layout for e in full.ranked[:3]]
    assert fast.best.predicted.step_time_s == full.best.predicted.step_time_s


# ----------------------------------------------------------------- memory model against closed forms


def test_1f1b_first_stage_holds_p_microbatches_of_activations(gpt2xl):
    """1F1B: stage i holds min(m, p - i) micro-batches, so stage 0's activations = p x its micro-batch bytes."""
    cl = hardware.parse_gpus("8xA100")
    ctx = Context(gpt2xl, cl, Settings.of(engine="deepspeed", mem_target=1.0), get_engine("deepspeed"))
    lay = Layout("deepspeed", 8, 1, 1, 1, 1, 32, 32, "1f1b", "none", 1)
    ev = evaluate_layout(ctx, lay, "bf16")
    assert not isinstance(ev, Rejection)
    for j, (a, b) in enumerate(zip(ev.bounds, ev.bounds[1:])):
        per_mb = activation_bytes_per_microbatch(gpt2xl, a, b, "none")
        assert ev.rank_memory[j]["activations"] == pytest.approx(min(32, 8 - j) * per_mb)


def test_gpipe_holds_every_microbatch(gpt2xl):
    cl = hardware.parse_gpus("4xA100")
    ctx = Context(gpt2xl, cl, Settings.of(engine="torch", mem_target=1.0), get_engine("torch"))
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
    res = search(llama7b, cl, Settings.of(engine="megatron"), get_engine("megatron"))
    for rm in res.best.rank_memory:
        parts = sum(v for k, v in rm.items() if k != "total")
        assert rm["total"] == pytest.approx(parts)
        assert rm["total"] <= 0.85 * cl.device_of(0).memory_bytes


# ----------------------------------------------------------------- nothing fits


def test_a_shortfall_under_a_tenth_of_a_gib_is_said_in_mib():
    from planner.planning import shortfall

    assert shortfall(6.8 * 2**30 + 12 * 2**20, 6.8 * 2**30) == "12 MiB"  # was "0.0 GiB short"
    assert shortfall(2**30 + 1000, 2**30) == "1 MiB"
    assert shortfall(3.25 * 2**30, 0.5 * 2**30) == "2.8 GiB"
    assert shortfall(0.1 * 2**30, None) == "0.1 GiB"


def test_nothing_fits_names_the_smallest_change():
    req = Settings.of(model_file=str(EX / "llama.py"), model_args={"preset": "llama-70b"}, gpus="8xA100", engine="deepspeed")
    with pytest.raises(InfeasibleError) as e:
        plan_model(req)
    assert e.value.exit_code == 1
    text = str(e.value)
    # how far the closest layout is from fitting, in GiB per GPU, and a concrete cluster that fits
    short = re.search(r"The closest layout, .*?, is ([0-9.]+) GiB short per GPU", text)
    assert short and float(short.group(1)) > 0, text
    hint = re.search(r"(\d+) GPUs \((\d+)x(\d+)x([\w-]+)\) would fit", text)
    assert hint, text
    gpus, nodes, per_node, device = int(hint[1]), int(hint[2]), int(hint[3]), hint[4]
    assert gpus == nodes * per_node and gpus > 8
    # the suggestion holds when planned for real (with the lean options the advice assumes) ...
    lean = req.but(gpus=f"{nodes}x{per_node}x{device}", micro_batch=1, recompute="full")
    plan = plan_model(lean)[0]
    assert plan.layout.pp * plan.layout.dp * plan.layout.tp == gpus
    # ... and it is the smallest of the sizes tried (twice as many nodes each time): half of it does not fit
    if nodes > 2:
        with pytest.raises(InfeasibleError):
            plan_model(lean.but(gpus=f"{nodes // 2}x{per_node}x{device}"))


# ----------------------------------------------------------------- heterogeneous clusters, memory dominance


def test_heterogeneous_cluster_costs_each_stage_on_its_own_device(gpt2xl):
    """8 H100 then 8 A100: pipeline rank 0 runs on H100s, rank 1 on A100s; each stage is timed on its own
    device and the split is the best of every cut (brute force over the single boundary)."""
    cl = hardware.parse_gpus("8xH100+8xA100")
    res = search(gpt2xl, cl, Settings.of(engine="torch", pp=2, dp=8, micro_batch=1, schedule="1f1b", recompute="none", mem_target=1.0), get_engine("torch"))
    best = res.best
    assert best is not None and best.devices == ["h100-sxm", "a100-80gb"]
    for r, rm in enumerate(best.rank_memory):
        assert rm["total"] <= cl.device_of(r * 8).memory_bytes
    per_device = [analytical_times(gpt2xl, cl.device_of(r * 8), "bf16", "none") for r in range(2)]
    k = best.bounds[1]
    # torch's Schedule1F1B waits on its sends: stage 0's forward holds the send of its output (StageTimes.blocking)
    send = cl.p2p_time(gpt2xl.cuts[k].bytes, 0, 8)
    assert best.stage_times.fwd[0] == pytest.approx(sum(per_device[0].fwd[:k]) + send)
    assert best.stage_times.fwd[1] == pytest.approx(sum(per_device[1].fwd[k:]))
    fast, slow = (np.cumsum([0.0, *t.total]) for t in per_device)
    n = gpt2xl.n
    bottleneck = [max(fast[c], slow[n] - slow[c]) for c in range(1, n)]
    chosen = max(fast[k], slow[n] - slow[k])
    assert chosen <= min(bottleneck) * 1.02  # point-to-point time is part of the DP's objective, not of this bound
    assert k > n - k  # the faster H100 stage holds more of the model


def test_memory_dominance_never_prunes_a_layout_that_fits(llama7b):
    """The search skips a layout that needs at least the memory of one already found not to fit
    (search._needs_no_less_memory); check that claim against pricing every pair on a tight cluster."""
    cl = hardware.parse_gpus("8xA10")
    engine = get_engine("torch")
    opts = Settings.of(engine="torch", top_k=5)
    ctx = Context(llama7b, cl, opts, engine)
    layouts, _ = enumerate_layouts(llama7b, cl, opts, engine, 64)
    verdict = {lay: evaluate_layout(ctx, lay, "bf16") for lay in layouts}
    no_fit = {lay for lay, ev in verdict.items() if isinstance(ev, Rejection) and ev.kind is RejectKind.MEMORY}
    claims = [(lay, other) for lay in layouts for other in no_fit if lay != other and _needs_no_less_memory(lay, other)]
    assert len(claims) > 20
    for lay, other in claims:
        assert lay in no_fit, f"{lay.short()} fits although it was claimed to need at least the memory of {other.short()}"


# ----------------------------------------------------------------- the search's caches against a straightforward reference


def _everything(res):
    """Every figure a search reports: counts, each ranked layout's split, times, memory and simulated step, and each
    rejection's reason and numbers (exact floats)."""
    ranked = [
        (e.layout, e.bounds, e.stage_rank, e.predicted, e.stage_times, e.stage_memory, e.rank_memory, e.sim.step_time, e.sim.busy, e.sim.peak_bytes)
        for e in res.ranked
    ]
    rejected = [(r.layout, r.reason, r.kind, r.lower_bound, r.need_bytes, r.capacity_bytes, r.bounds) for r in res.rejected]
    return res.considered, res.priced, res.global_batch, ranked, rejected


@pytest.mark.parametrize(("engine", "gpus", "mem", "exhaustive"), [("megatron", "16xA100-40GB", 0.85, False), ("megatron", "8xA100-40GB", 0.5, True)])
def test_the_fast_search_reports_what_the_straightforward_one_does(gpt2xl, monkeypatch, engine, gpus, mem, exhaustive):
    """The same search with every shortcut of the pricing replaced by its straightforward form (the partition DP and
    the sum proof over every piece boundary, no remembered count-point answers, simulations, rank devices or send
    times) reports the same thing, bit for bit: the same layouts priced, ranked and rejected, with the same figures."""
    from planner.solve import partition as part
    from planner.solve import rank_memory as rmem
    from planner.solve import search as srch
    from tests.solve.test_partition import _reference_solve
    from tests.solve.test_rank_memory import _reference_min_sum

    cl = hardware.parse_gpus(gpus)
    opts = Settings.of(engine=engine, top_k=3, mem_target=mem, exhaustive=exhaustive)
    fast = _everything(search(gpt2xl, cl, opts, get_engine(engine)))

    def uncached(method, store):
        def call(self, *a, **k):
            getattr(self, store).clear()
            return method(self, *a, **k)

        return call

    monkeypatch.setattr(part, "solve", _reference_solve)
    monkeypatch.setattr(rmem, "_min_sum", _reference_min_sum)
    monkeypatch.setattr(rmem, "derived", lambda what, points, make: make())
    monkeypatch.setattr(srch.Context, "simulated", lambda self, *a: srch._simulate_extrapolated(*a))
    monkeypatch.setattr(srch.Context, "rank_devices", uncached(srch.Context.rank_devices, "_devices"))
    monkeypatch.setattr(srch.Context, "boundary_sends", uncached(srch.Context.boundary_sends, "_sends"))
    slow = _everything(search(gpt2xl, cl, opts, get_engine(engine)))
    assert slow[:3] == fast[:3]
    assert slow[3] == fast[3]
    assert slow[4] == fast[4]
    assert fast[3], "the case should rank layouts"


@pytest.mark.parametrize(
    ("name", "v"), [("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1), ("interleaved-zb", 2), ("zbv", 2), ("dualpipev", 2), ("looped-bfs", 2)]
)
def test_extrapolated_step_matches_the_full_simulation(monkeypatch, name, v):
    """Many micro-batches are priced from two shorter simulations, extended linearly: against simulating every
    micro-batch, with unequal stage times and send delays drawn at random, the step and each rank's busy time agree to
    1% (extrapolating from 2p and 4p, as before, erred by up to 2.4% on these cases)."""
    import random

    from planner.solve import search as srch
    from planner.solve.schedules import build_schedule
    from planner.solve.simulate import StageMemory, StageTimes, simulate

    monkeypatch.setattr(srch, "EXTRAPOLATE_ACTIONS", 0)
    for seed in range(10):
        rng = random.Random(seed)
        for p in (2, 4):
            S, m = p * v, 24 * p
            times = StageTimes(
                fwd=[rng.uniform(0.5, 1.5) for _ in range(S)],
                bwd_input=[rng.uniform(1.0, 3.0) for _ in range(S)],
                bwd_weight=[rng.uniform(0.0, 1.0) for _ in range(S)],
                send_fwd=[rng.uniform(0.0, 0.3) for _ in range(S - 1)],
                send_bwd=[rng.uniform(0.0, 0.3) for _ in range(S - 1)],
            )
            mem = StageMemory(activation=[1.0] * S, wgrad_pending=[0.5] * S)
            got = srch._simulate_extrapolated(name, p, m, v, times, mem)
            full = simulate(build_schedule(name, p, m, v), times, mem, timeline=False)
            assert got.step_time == pytest.approx(full.step_time, rel=0.01), (seed, p)
            assert got.busy == pytest.approx(full.busy, rel=0.01), (seed, p)


def test_nothing_fits_on_deepspeed_names_megatron_for_experts():
    """issue: an MoE model that no DeepSpeed layout fits at any size (a stage holds all of a layer's experts: DeepSeek-V3
    on 64 H100) was told "Try more GPUs, --recompute full, --micro-batch 1", all of which the search had tried; the
    advice now names Megatron's expert parallelism where it fits, and that holds when planned for real."""
    req = Settings.of(
        model_file=str(EX / "moe.py"),
        model_args={"preset": "deepseek-v3", "n_layers": "5", "seq_len": "1024"},
        gpus="8xH100",
        engine="deepspeed",
    )
    with pytest.raises(InfeasibleError) as e:
        plan_model(req)
    text = str(e.value)
    assert "Smallest change that fits: --engine megatron (expert parallelism shards the experts) would fit." in text, text
    assert "--recompute full" not in text.split("Smallest change")[1] and "--micro-batch 1" not in text.split("Smallest change")[1]
    plan = plan_model(req.but(engine="megatron"))[0]
    assert plan.layout.ep > 1
