"""The all-to-all token dispatcher's own work and the routed experts' FP8 casts, in closed form; dense rows unchanged."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from planner import hardware
from planner.solve.search import fp8_casts
from planner.solve.timing import analytical_times, fp8_cast_bytes, moe_dispatcher_terms, moe_fp8_cast_bytes, overlapped_dispatch_time, paired_share
from tests.conftest import costs_of


def _h100_cluster(spec: str = "8xH100", sync_s: float = 0.0):
    cluster = hardware.parse_gpus(spec)
    return cluster, dataclasses.replace(cluster.device_of(0), p2p_sync_s=sync_s)


def test_dispatcher_terms_in_closed_form_one_node():
    # 4096 tokens x top-8 = 32768 rows of h = 2048 in bf16 (134,217,728 bytes), 128 experts over ep 8 in one node:
    # 16 local experts, so permutation 2 copies the rows twice forward and twice backward (read + write each)
    cluster, dev = _h100_cluster(sync_s=20e-6)
    rows, nbytes = 32768.0, 32768.0 * 2048 * 2
    fwd, bwd = moe_dispatcher_terms(cluster, dev, rows, nbytes, 128, 0, 8, 1)
    copy = hardware.memory_time(2 * nbytes, dev, bytes_per_op=2 * nbytes)
    # probabilities: 32768 rows x 2 bytes over the 8 GPUs of the node, 7/8 of them over NVLink, plus one NVLink latency
    probs = 65536 * 7 / 8 / (450e9 * 0.82) + 5e-6
    # token counts: 128 experts x 8 bytes from each of 8 GPUs, a ring all-gather of 8192 bytes: 7 steps
    counts = cluster.all_gather_time(8192.0, list(range(8)))
    assert counts == pytest.approx(8192 * 7 / 8 / (450e9 * 0.82) + 7 * 5e-6, rel=1e-6)
    assert fwd == pytest.approx(20e-6 + 2 * copy + probs + counts, rel=1e-12)
    assert bwd == pytest.approx(2 * copy + probs, rel=1e-12)


def test_dispatcher_terms_drop_what_the_layout_does_not_run():
    cluster, dev = _h100_cluster()
    rows, nbytes = 1000.0, 1000.0 * 64 * 2
    # one local expert per GPU (ep = experts): no permutation 2; the profile has no synchronisation figure: no sync
    fwd, bwd = moe_dispatcher_terms(cluster, dev, rows, nbytes, 8, 0, 8, 1)
    probs = cluster.all_to_all_time(rows * 2, list(range(8)))
    assert fwd == pytest.approx(probs + cluster.all_gather_time(8.0 * 8 * 8, list(range(8))), rel=1e-12)
    assert bwd == pytest.approx(probs, rel=1e-12)
    # ep = etp = 1: nothing crosses GPUs, only permutation 2 of the 8 local experts' rows remains
    copy = hardware.memory_time(2 * nbytes, dev, bytes_per_op=2 * nbytes)
    assert moe_dispatcher_terms(cluster, dev, rows, nbytes, 8, 0, 1, 1) == pytest.approx((2 * copy, 2 * copy), rel=1e-12)
    # etp 2: the expert-TP gather doubles the rows permutation 2 sorts
    copy2 = hardware.memory_time(4 * nbytes, dev, bytes_per_op=4 * nbytes)
    f2, b2 = moe_dispatcher_terms(cluster, dev, rows, nbytes, 8, 0, 2, 2)
    assert b2 - 2 * copy2 == pytest.approx(cluster.all_to_all_time(rows * 2, [0, 2]) + cluster.all_gather_time(rows * 2 * 2, [0, 1]), rel=1e-9)
    assert moe_dispatcher_terms(cluster, dev, 0.0, 0.0, 8, 0, 8, 1) == (0.0, 0.0)


def test_expert_fp8_casts_in_closed_form():
    arch = {"hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "activation": "swiglu", "ffn_hidden_size": 256, "moe_ffn_hidden_size": 32}
    # 100 routed rows per GPU, etp 2: FC1 reads 200 gathered rows x 64, FC2 reads 100 x 32 (200 rows x 32/2);
    # backward: FC2's output gradient 200 x 64, FC1's 100 x 64 (200 rows x 2 x 32 / 2): 4 bytes per element
    fwd, bwd = moe_fp8_cast_bytes(arch, "mlp", 512.0, 2, 100.0, 2)
    assert fwd == [4 * 200 * 64, 4 * 100 * 32]
    assert bwd == [4 * 200 * 64, 4 * 100 * 64]
    # no dense MLP of ffn_hidden_size (256) in a MoE piece; shared experts of width 48 are a tensor-parallel MLP
    shared = dict(arch, moe_shared_expert_intermediate_size=48)
    fwd, bwd = moe_fp8_cast_bytes(shared, "mlp", 512.0, 2, 100.0, 1)
    assert fwd == [4 * 512 * 64, 4 * 512 * 24, 4 * 100 * 64, 4 * 100 * 32]
    assert bwd == [4 * 512 * 48, 4 * 512 * 64, 4 * 100 * 64, 4 * 100 * 64]
    # a whole block without shared experts keeps its attention's casts
    attn = fp8_cast_bytes(arch, "attention", 512.0, 2)
    fwd, bwd = moe_fp8_cast_bytes(arch, "block", 512.0, 2, 100.0, 1)
    assert fwd == attn[0] + [4 * 100 * 64, 4 * 100 * 32] and bwd == attn[1] + [4 * 100 * 64, 4 * 100 * 64]


def test_fp8_casts_of_a_moe_model_price_the_routed_rows_a_gpu_routes():
    c = costs_of("moe", "moe-tiny")
    arch = c.architecture
    casts, _ = fp8_casts(c, 2, 2, 1, 2, 1)
    for l, (f, b) in zip(c.layers, casts or []):
        if l.num_experts:
            rows = l.routed_rows * 2 / c.micro_batch / 2  # micro-batch 2, sequence parallelism over tp 2
            assert (f, b) == moe_fp8_cast_bytes(arch, l.kind, c.seq_len * 2, 2, rows, 1)
            assert f[-2] == 4 * rows * arch["hidden_size"]
        else:
            assert (f, b) == fp8_cast_bytes(arch, l.kind, c.seq_len * 2, 2)


def test_dispatcher_terms_reach_moe_pieces_only():
    c = costs_of("moe", "deepseek-tiny")
    dev = hardware.parse_gpus("8xH100").device_of(0)
    terms = [(3e-4, 5e-4)] * len(c.layers)
    plain = analytical_times(c, dev, "bf16", experts=(4, 1, 0.0))
    more = analytical_times(c, dev, "bf16", experts=(4, 1, 0.0), dispatcher_terms=terms)
    for l, f0, f1, i0, i1, w0, w1 in zip(c.layers, plain.fwd, more.fwd, plain.bwd_input, more.bwd_input, plain.bwd_weight, more.bwd_weight):
        extra = (3e-4, 5e-4) if l.num_experts else (0.0, 0.0)
        assert (f1 - f0, i1 - i0, w1 - w0) == pytest.approx((*extra, 0.0), abs=1e-15)


def test_dense_published_rows_are_bit_identical(monkeypatch):
    """Dense rows never reach the dispatcher or the expert casts: with both made absurd their step does not move by a bit."""
    from bench import published_runs as pr
    from planner.solve import search

    runs = [next(r for r in pr.RUNS_ALL if r.id == rid) for rid in ("C1", "M24-70b", "N-llama2-70b", "MLM-mixtral-8x7b")]
    before = [pr.predict(run).predicted_step_s for run in runs]
    monkeypatch.setattr(search, "moe_dispatcher_terms", lambda *a, **k: (1e-1, 1e-1))
    monkeypatch.setattr(search, "moe_fp8_cast_bytes", lambda *a, **k: ([1e15], [1e15]))
    after = [pr.predict(run).predicted_step_s for run in runs]
    assert after[:3] == before[:3]
    assert after[3] > 2 * before[3]  # the MoE row does reach the patched terms


# --------------------------------------------------------------------------- --overlap-moe-expert-parallel-comm


def test_overlapped_dispatch_in_closed_form():
    # three phases: combine_bwd | attn_fwd, dispatch fwd + bwd | mlp bwd + fwd, combine_fwd | attn_bwd
    assert overlapped_dispatch_time(1.0, 0.25, 0.5, 0.5, 1.0) == pytest.approx((0.5 + 0.25, 0.75 + 0.25))
    # enough computation everywhere: nothing exposed; none at all: the four all-to-alls, two each way
    assert overlapped_dispatch_time(1.0, 2.0, 2.0, 1.0, 1.0) == (0.0, 0.0)
    assert overlapped_dispatch_time(1.0, 0.0, 0.0, 0.0, 0.0) == (2.0, 2.0)


def test_overlap_hides_the_dispatch_behind_the_layer_of_another_micro_batch():
    c = costs_of("moe", "deepseek-tiny")
    dev = hardware.parse_gpus("8xH100").device_of(0)
    a2a = 1e-3
    plain = analytical_times(c, dev, "bf16", experts=(4, 1, 0.0))
    over = analytical_times(c, dev, "bf16", experts=(4, 1, a2a), ep_overlap=1.0)
    seen = 0
    for k, l in enumerate(c.layers):
        if not l.num_experts:
            assert (over.fwd[k], over.bwd_input[k]) == (plain.fwd[k], plain.bwd_input[k])
            continue
        prev = c.layers[k - 1]
        assert prev.block == l.block and prev.kind == "attention"
        attn_f, attn_b = plain.fwd[k - 1], plain.bwd_input[k - 1] + plain.bwd_weight[k - 1]
        mlp_f, mlp_b = plain.fwd[k], plain.bwd_input[k] + plain.bwd_weight[k]
        mid = max(0.0, 2 * a2a - mlp_f - mlp_b)
        assert over.fwd[k] - mlp_f == pytest.approx(max(0.0, a2a - attn_b) + mid / 2, abs=1e-15)
        assert over.bwd_input[k] - plain.bwd_input[k] == pytest.approx(max(0.0, a2a - attn_f) + mid / 2, abs=1e-15)
        assert over.bwd_weight[k] == plain.bwd_weight[k]
        seen += 1
    assert seen == sum(1 for l in c.layers if l.num_experts) > 0


def test_paired_share_in_closed_form():
    # no pipelining: forwards 2 ... m pair with backwards 1 ... m - 1
    assert paired_share(1, 1, 8, 1) == 7 / 8 and paired_share(1, 1, 1, 1) == 0.0
    # pp 2, vp 2, m 4, groups of 2: 8 chunk passes per rank; warm-up 2 (1 - r) + 1 x 2 + 1 = 5 and 3 forwards
    assert paired_share(2, 2, 4, 2) == pytest.approx(((8 - 5) / 8 + (8 - 3) / 8) / 2)
    # half paired: half of each pass's all-to-alls exposed in full, half as overlapped
    c = costs_of("moe", "deepseek-tiny")
    dev = hardware.parse_gpus("8xH100").device_of(0)
    full = analytical_times(c, dev, "bf16", experts=(4, 1, 1e-3))
    over = analytical_times(c, dev, "bf16", experts=(4, 1, 1e-3), ep_overlap=1.0)
    half = analytical_times(c, dev, "bf16", experts=(4, 1, 1e-3), ep_overlap=0.5)
    for a, b, h in zip(full.fwd + full.bwd_input, over.fwd + over.bwd_input, half.fwd + half.bwd_input):
        assert h == pytest.approx((a + b) / 2, rel=1e-12)


def test_overlap_is_searched_where_megatron_runs_it():
    from planner.engines import get_engine
    from planner.solve.plan import Layout, ep_overlap_allowed
    from planner.solve.search import with_options
    from planner.solve.settings import Settings

    eng = get_engine("megatron")
    base = Layout("megatron", 2, 1, 4, 2, 1, 8, 32, "interleaved", "none", 1, ep=2)
    opts = Settings.of(engine="megatron", global_batch=32)
    assert sorted(l.ep_comm_overlap for l in with_options(base, opts, eng)) == [False, True]
    for bad in (
        dataclasses.replace(base, ep=1),
        dataclasses.replace(base, vp=1, schedule="1f1b"),
        dataclasses.replace(base, recompute="full"),
    ):
        assert not ep_overlap_allowed(bad)
        assert [l.ep_comm_overlap for l in with_options(bad, opts, eng)] == [False]
        pinned = with_options(bad, opts.but(ep_comm_overlap=True), eng)
        assert any("--overlap-moe-expert-parallel-comm needs" in p for p in eng.feature_problems(pinned[0], costs_of("moe", "moe-tiny")))
    # no pipeline: the combined schedule without pipelining
    assert ep_overlap_allowed(dataclasses.replace(base, pp=1, vp=1, schedule="1f1b"))
    assert "overlap-moe-expert-parallel-comm" in dataclasses.replace(base, ep_comm_overlap=True).overlaps


def test_overlap_holds_one_micro_batch_more():
    """The combined 1F1B schedule runs the next micro-batch's forward against this one's backward: without pipelining
    a rank holds two micro-batches' activations, not one; on an interleaved rank one (stage, micro-batch) more."""
    from planner.engines import get_engine
    from planner.solve import rank_memory as rmem
    from planner.solve.plan import Layout
    from planner.solve.search import Context, evaluate_layout, one_more_in_flight
    from planner.solve.settings import Settings

    c = costs_of("moe", "moe-tiny")
    cl = hardware.parse_gpus("4xH100")
    ctx = Context(c, cl, Settings.of(engine="megatron", global_batch=8, mem_target=1.0), get_engine("megatron"))
    lay = Layout("megatron", 1, 1, 4, 1, 1, 2, 8, "1f1b", "none", 1, ep=2)
    off, on = (evaluate_layout(ctx, dataclasses.replace(lay, ep_comm_overlap=x), c.dtype) for x in (False, True))
    assert on.rank_memory[0]["activations"] == pytest.approx(2 * off.rank_memory[0]["activations"], rel=1e-12)
    pts = rmem.order_points("interleaved", 2, 4, 2)
    more = one_more_in_flight(pts)
    for a, b in zip(pts, more):
        k = len(a.stages)
        assert b.held.shape == (k * a.held.shape[0], k)
        assert b.held.sum(axis=1).max() == a.held.sum(axis=1).max() + 1
        assert np.all(b.held.max(axis=0) == a.held.max(axis=0) + 1)
