"""Context parallelism's key/value exchanges (Megatron --cp-comm-type, Transformer Engine's cp_comm_type): the ring
(p2p), the exposed all-gather and the DeepSpeed-Ulysses all-to-all, searched, priced and rendered.

References: the collectives' closed forms (ring all-gather and reduce-scatter, bytes over bus bandwidth); the reshape
Transformer Engine's all-to-all runs on q, k and v, replayed with torch on meta tensors; megatron-core's own
TransformerConfig; Megatron-LM's parse_args / validate_args where a checkout is named (tests/mlm_validate.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from planner import hardware
from planner.engines import get_engine
from planner.solve.mesh import cp_comm_problems
from planner.solve.search import Context, enumerate_layouts, evaluate_layout, search
from planner.solve.settings import Settings
from planner.solve.timing import cp_exchange_exposed, kv_bytes, q_bytes
from tests.conftest import costs_of

SEQ = 8192


@pytest.fixture(scope="module")
def llama1b():
    """Llama 1B (32 heads, 8 key/value heads, hidden 2048) at 8,192 tokens."""
    return costs_of("llama", "llama-1b", seq_len=SEQ)


def test_block_bytes_are_the_closed_forms(llama1b):
    """One rank's blocks at micro-batch 1, bf16: q = s/cp x hidden/tp x 2; k + v = 2 x s/cp x (8 x 64)/tp x 2."""
    assert q_bytes(llama1b, 2, 4) == SEQ / 4 * 2048 / 2 * 2
    assert kv_bytes(llama1b, 2, 4) == 2 * SEQ / 4 * (8 * 64) / 2 * 2


@pytest.mark.parametrize("comm", ["all_gather", "a2a"])
def test_exchange_seconds_are_the_collectives_closed_forms(comm):
    """4 H100 of one NVLink node: a ring all-gather producing N bytes takes (n-1)/n N / busbw + (n-1) latency, a
    reduce-scatter the same; an all-to-all of B bytes per rank (n-1)/n B over the intra-node link. Transformer Engine
    gathers K and V apart (forward, and again backward) and reduce-scatters dK and dV; Ulysses moves q, k, v and the
    output forward, the output gradient and dq, dk, dv backward."""
    cl = hardware.parse_gpus("8xH100")
    ranks = [0, 2, 4, 6]  # cp 4 at tp 2: the ring's GPUs, tp apart
    q, kv = 8e6, 4e6
    fwd, bwd = cp_exchange_exposed(cl, comm, q, kv, ranks)
    busbw, lat = cl.bus_bandwidth(cl._rank_array(ranks))
    n = len(ranks)
    ring = (n - 1) / n * (n * kv / 2) / busbw + (n - 1) * lat
    if comm == "all_gather":
        assert fwd == pytest.approx(2 * ring, rel=1e-12)
        assert bwd == pytest.approx(4 * ring, rel=1e-12)
    else:
        assert fwd == bwd == pytest.approx(2 * cl.all_to_all_time(q, ranks) + 2 * cl.all_to_all_time(kv / 2, ranks), rel=1e-12)
        dev = cl.device_of(0)
        # one node: each rank sends (n-1)/n of its bytes over NVLink, at least that long (cluster.all_to_all_time)
        assert cl.all_to_all_time(q, ranks) >= (n - 1) / n * q / (dev.intra_bandwidth * dev.allreduce_efficiency_intra)
    assert cp_exchange_exposed(cl, comm, q, kv, [0]) == (0.0, 0.0)
    assert cp_exchange_exposed(cl, "p2p", q, kv, ranks) == (0.0, 0.0)


@pytest.mark.parametrize(("heads", "groups", "tp", "cp"), [(32, 8, 1, 2), (32, 8, 2, 4), (32, 8, 4, 4), (32, 8, 1, 16), (12, 12, 1, 8), (12, 4, 2, 2)])
def test_the_a2a_head_rule_is_the_reshape_transformer_engine_runs(heads, groups, tp, cp):
    """flash_attn_a2a_communicate views each of q, k, v as [..., cp, heads // cp, d] (Transformer Engine
    context_parallel.py): the planner refuses exactly where that view fails on a GPU's heads."""
    d = 8

    def reshapes(h: int) -> bool:
        x = torch.empty(1, 4, h, d, device="meta")
        try:
            x.view(1, 4, cp, x.shape[-2] // cp, d)
        except RuntimeError:
            return False
        return True

    runs = heads % tp == 0 and groups % tp == 0 and reshapes(heads // tp) and reshapes(groups // tp)
    problems = cp_comm_problems("a2a", cp, tp, {"num_attention_heads": heads, "num_query_groups": groups})
    assert (problems == []) == runs
    assert cp_comm_problems("all_gather", cp, tp, {"num_attention_heads": heads, "num_query_groups": groups}) == []


def test_the_search_tries_each_exchange_and_prices_what_it_exposes(llama1b):
    """At cp > 1 Megatron's three exchanges are candidates (a2a where the heads divide); the pinned layouts differ by
    exactly the exchange's exposed seconds on each attention piece (the ring here is hidden behind the attention core,
    s/cp = 4,096 queries a rank), and the all-gather's stage holds the gathered keys and values."""
    cl = hardware.parse_gpus("8xH100")
    eng = get_engine("megatron")
    opts = Settings.of(engine="megatron", global_batch=8, cp=4, tp=2, pp=1)
    layouts, _ = enumerate_layouts(llama1b, cl, opts, eng, 8)
    assert {lay.cp_comm for lay in layouts} == {"p2p", "all_gather", "a2a"}
    ctx = Context(llama1b, cl, opts, eng)
    by = {}
    for comm in ("p2p", "all_gather", "a2a"):
        lay = next(lay for lay in layouts if lay.cp_comm == comm and lay.micro_batch == 1 and not lay.tp_comm_overlap and lay.recompute == "none")
        by[comm] = (lay, ctx.times(1, 2, "none", 0, "bf16", True, 4, cp_comm=comm))
    ring = by["p2p"][1]
    attn = [k for k, l in enumerate(llama1b.layers) if l.kind in ("attention", "block")]
    assert len(attn) == 16
    for comm in ("all_gather", "a2a"):
        f, b = ctx._cp_exchange(1, 2, 0, 4, comm)
        assert f > 0 and b > 0
        t = by[comm][1]
        for k in range(llama1b.n):
            want_f, want_b = (f, b) if k in attn else (0.0, 0.0)
            assert t.fwd[k] - ring.fwd[k] == pytest.approx(want_f, rel=1e-9, abs=1e-15)
            assert t.bwd_input[k] - ring.bwd_input[k] == pytest.approx(want_b, rel=1e-9, abs=1e-15)
    evs = {c: evaluate_layout(ctx, by[c][0], "bf16") for c in by}
    gathered = (2 * 4 - 1) * kv_bytes(ctx.scaled(1), 2, 4)
    extra = evs["all_gather"].rank_memory[0]["buffers"] - evs["p2p"].rank_memory[0]["buffers"]
    assert evs["all_gather"].bounds == evs["p2p"].bounds == (0, llama1b.n)
    assert extra == pytest.approx(gathered, rel=1e-9)
    assert evs["all_gather"].predicted.step_time_s > evs["p2p"].predicted.step_time_s


def test_a_pinned_exchange_is_planned_with_context_parallelism_only(llama1b):
    cl = hardware.parse_gpus("8xH100")
    res = search(llama1b, cl, Settings.of(engine="megatron", global_batch=8, cp_comm="a2a"), get_engine("megatron"))
    assert res.best is not None and res.best.layout.cp > 1 and all(e.layout.cp_comm == "a2a" for e in res.ranked)


@pytest.mark.parametrize("comm", ["all_gather", "a2a"])
def test_rendered_exchange_passes_megatron_rules_and_megatron_core(tmp_path, comm):
    """The plan renders --cp-comm-type; the planner's Megatron rules accept it, megatron-core's TransformerConfig
    carries it, validate reads it back, and Megatron-LM's own validate_args accepts it where a checkout is named."""
    from planner.engines.megatron.architecture import check_megatron_args
    from planner.engines.megatron.core_check import core_config
    from planner.engines.megatron.render import render as render_megatron
    from planner.engines.megatron.script import parse_megatron_args
    from planner.planning import plan_model
    from tests.mlm_validate import megatron_lm_config, megatron_lm_path

    req = Settings.of(
        model_file="examples/llama.py", model_args={"preset": "llama-1b", "seq_len": SEQ}, gpus="8xH100", engine="megatron", cp=4, tp=2, cp_comm=comm
    )
    plan = plan_model(req)[0]
    assert plan.layout.cp_comm == comm
    args = parse_megatron_args(render_megatron(plan, "c", tmp_path)["pretrain_gpt.sh"])
    assert args.value("--cp-comm-type") == comm
    assert check_megatron_args(args) == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = core_config(args)
    assert cfg.cp_comm_type == comm and cfg.context_parallel_size == 4
    if megatron_lm_path() is not None:
        lm_args, lm_cfg = megatron_lm_config(args.argv(), plan.layout.world)
        assert lm_cfg.cp_comm_type == comm


def test_megatron_rules_refuse_an_exchange_transformer_engine_cannot_run():
    from planner.engines.megatron.architecture import check_megatron_args
    from planner.engines.megatron.script import parse_megatron_args

    base = (
        "torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 4 --hidden-size 512 --num-attention-heads 8 "
        "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 8 --bf16 "
        "--context-parallel-size 8 "
    )
    for extra, why in (
        ("--cp-comm-type ring", "Transformer Engine runs"),
        ("--cp-comm-type a2a+p2p", "hierarchical"),
        ("--cp-comm-type p2p a2a", "one per layer"),
    ):
        found = [f for f in check_megatron_args(parse_megatron_args("export CUDA_DEVICE_MAX_CONNECTIONS=1\n" + base + extra)) if f.rule == "MEG044"]
        assert found and why in found[0].message, (extra, found)
    ok = check_megatron_args(parse_megatron_args("export CUDA_DEVICE_MAX_CONNECTIONS=1\n" + base + "--cp-comm-type a2a"))
    assert not [f for f in ok if f.rule == "MEG044"]  # 8 heads over cp 8: one each
    bad = check_megatron_args(
        parse_megatron_args(
            "export CUDA_DEVICE_MAX_CONNECTIONS=1\n" + base.replace("--num-attention-heads 8", "--num-attention-heads 12") + "--cp-comm-type a2a"
        )
    )
    assert [f for f in bad if f.rule == "MEG044"]


def test_the_command_line_answers_a_bad_exchange_with_exit_2():
    """An engine without context parallelism, a name Megatron's engine does not plan, and a pin that cannot apply (a
    32-token model, below the sequence the search tries cp for) are each refused with exit 2 and a line saying why."""
    from typer.testing import CliRunner

    from planner.cli import app

    base = ["plan", "examples/llama.py", "--model-arg", "preset=llama-tiny", "--gpus", "8xH100", "--quiet"]
    cases = (
        (["--engine", "deepspeed", "--cp-comm-type", "a2a"], "runs no context parallelism"),
        (["--engine", "megatron", "--cp-comm-type", "ring"], "Accepted: p2p, all_gather, a2a"),
        (["--engine", "megatron", "--cp-comm-type", "a2a"], "tried from 8192 tokens"),
        (["--engine", "megatron", "--cp", "1", "--cp-comm-type", "a2a"], "--cp 1 exchanges nothing"),
    )
    for extra, why in cases:
        r = CliRunner().invoke(app, [*base, *extra])
        assert r.exit_code == 2 and why in r.output, (extra, r.exit_code, r.output)


@pytest.mark.parametrize("comm", ["all_gather", "a2a"])
def test_a_fully_pinned_layout_is_priced_with_its_exchange(comm):
    """`smoke`, `validate` and `calibrate` re-price a plan with every dimension pinned (Settings.pinned_to,
    planning.evaluate_pinned): the exchange the plan chose is priced again, not the engine's default ring."""
    from planner.planning import evaluate_pinned, plan_model
    from tests.conftest import EXAMPLES

    req = Settings.of(
        model_file=str(EXAMPLES / "llama.py"),
        model_args={"preset": "llama-1b", "seq_len": SEQ},
        gpus="16xH100",
        engine="megatron",
        cp=2,
        tp=2,
        cp_comm=comm,
    )
    plan, analysis, _ = plan_model(req)
    bounds = tuple([st.pieces[0] for st in plan.stages] + [plan.stages[-1].pieces[1]])
    again = evaluate_pinned(analysis.costs, hardware.parse_gpus("16xH100"), Settings.pinned_to(plan.inputs, plan.layout, bounds))
    assert again.best is not None and again.best.layout.cp_comm == comm
    assert again.best.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s)
