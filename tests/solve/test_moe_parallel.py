"""Expert parallelism: experts found by structure, their memory and time in closed form, the all-to-all, the
(ep, etp) search against a brute force, Megatron's expert groups, and the --ep / --etp pins."""

import dataclasses
import json
import math

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from planner import hardware
from planner.cli import app
from planner.engines import get_engine
from planner.model.experts import expert_parameters, router_parameters
from planner.records import Layer
from planner.solve.mesh import Mesh
from planner.solve.plan import Layout
from planner.solve.search import (
    Context,
    dispatch_buffer_bytes,
    enumerate_layouts,
    expert_saved_extra,
    price_layout,
    search,
)
from planner.solve.settings import Settings
from planner.solve.timing import analytical_times, expert_dispatch_time, expert_gemm_time
from tests.conftest import EXAMPLES, costs_of

runner = CliRunner()


# ---------------------------------------------------------------- finding the experts


class _ListExperts(nn.Module):
    """A ModuleList of identical expert MLPs under a module with ``num_local_experts`` (transformers 4 style)."""

    def __init__(self, d=8, f=16, e=4):
        super().__init__()
        self.num_local_experts = e
        self.gate = nn.Linear(d, e, bias=False)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(d, f), nn.Linear(f, d)) for _ in range(e)])
        self.shared = nn.Linear(d, d)


def test_finder_takes_3d_expert_weights_and_expert_module_lists_not_shared_or_router():
    found = expert_parameters(_ListExperts())
    assert set(found) == {f"experts.{i}.{j}.{w}" for i in range(4) for j in (0, 1) for w in ("weight", "bias")}
    assert set(found.values()) == {4}
    assert router_parameters(_ListExperts()) == {"gate.weight"}
    import importlib.util

    spec = importlib.util.spec_from_file_location("moe_example", EXAMPLES / "moe.py")
    moe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moe)
    with torch.device("meta"):
        m = moe.build_model("deepseek-tiny")
    found = expert_parameters(m)
    # deepseek-tiny: 4 layers, first dense, 8 experts of 3 weights each in layers 1..3; shared experts are dense
    assert sorted(found) == sorted(f"layers.{i}.feed_forward.experts.{w}" for i in (1, 2, 3) for w in ("w1", "w2", "w3"))
    assert router_parameters(m) == {f"layers.{i}.feed_forward.router.gate.weight" for i in (1, 2, 3)}


def test_finder_takes_transformers_mixtral_experts():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, vocab_size=64
    )
    with torch.device("meta"):
        m = transformers.MixtralForCausalLM(cfg)
    found = expert_parameters(m)
    assert sorted(found) == sorted(f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("gate_up_proj", "down_proj"))
    assert sum(p.numel() for n, p in m.named_parameters() if n in found) == 2 * 4 * 3 * 16 * 32


def test_costs_record_expert_params_rows_and_grouped_gemms_in_closed_form():
    c = costs_of("moe", "deepseek-tiny")
    d, E, f, k, s, shared_f = 64, 8, 32, 2, 32, 32  # examples/moe.py deepseek-tiny
    moe_pieces = [l for l in c.layers if l.num_experts]
    assert [l.name for l in moe_pieces] == [f"layers.{i}:feed_forward" for i in (1, 2, 3)]
    for l in moe_pieces:
        assert l.num_experts == E
        assert l.expert_params == E * 3 * d * f
        assert l.routed_rows == s * k and l.routed_bytes == s * k * d * 2  # bf16 rows entering the experts
        assert l.expert_op_flops_fwd == (2.0 * s * k * d * f,) * 3  # w1, w3, w2: 2 x rows x d x f each
        assert sum(l.expert_op_flops_bwd) == 2 * sum(l.expert_op_flops_fwd)  # input and weight gradients
        # shared experts are dense and split by tp; the router is kept whole; experts are not tp-shardable
        assert l.shardable_params == 3 * d * shared_f
        assert l.params == l.expert_params + 3 * d * shared_f + d * E + d  # + router + ffn norm
    dense = c.layers[[l.name for l in c.layers].index("layers.0:feed_forward")]
    assert dense.expert_params == 0 and dense.num_experts == 0 and dense.expert_op_flops_fwd == ()


def test_layer_records_without_expert_fields_still_load():
    old = {"name": "x", "kind": "mlp", "params": 4, "param_bytes": 8, "flops_fwd": 1.0, "flops_bwd": 2.0, "saved_bytes": 0, "out_bytes": 0}
    l = Layer.from_dict(old)
    assert (l.expert_params, l.num_experts, l.routed_rows, l.expert_op_flops_fwd) == (0, 0, 0.0, ())
    assert Layer.from_dict(l.to_dict()) == l


# ---------------------------------------------------------------- memory of a stage, written out by hand


def _state_per_gpu(dense_sharded, replicated, experts, tp, dp, cp, ep, etp):
    """Megatron bf16 + distributed optimizer: bf16 weights (2), fp32 main grads (4) per held parameter; fp32 master +
    Adam moments (12) sharded over dp x cp for dense weights and over tp x cp x dp / (ep x etp) for experts."""
    dense = dense_sharded / tp + replicated
    exp = experts / (ep * etp)
    edp = tp * cp * dp // (ep * etp)
    return 2 * (dense + exp), 4 * (dense + exp), 12 * dense / (dp * cp) + 12 * exp / edp


def _priced(costs, gpus, **lay):
    cluster = hardware.parse_gpus(gpus)
    layout = Layout(
        "megatron", 1, lay["tp"], lay["dp"], 1, 1, lay.get("m", 1), lay["dp"] * lay.get("m", 1), "1f1b", "full", 1, lay["tp"] > 1, ep=lay["ep"], etp=lay["etp"]
    )
    opts = Settings.of(engine="megatron", global_batch=layout.global_batch, mem_target=1.0)
    ev = price_layout(Context(costs, cluster, opts, get_engine("megatron")), layout, costs.dtype, bounds=(0, costs.n))
    assert not hasattr(ev, "reason"), getattr(ev, "reason", "")
    return ev


def test_mixtral_shaped_stage_memory_by_hand():
    c = costs_of("moe", "mixtral-8x7b", n_layers=2)
    d, H, kv, hd, f, E, V, L = 4096, 32, 8, 128, 14336, 8, 32000, 2
    attention = d * H * hd + 2 * d * kv * hd + H * hd * d
    dense_sharded = L * attention + 2 * V * d  # attention, embedding and output head (vocabulary parallel)
    replicated = L * (2 * d + d * E) + d  # norms and routers on every GPU, the final norm
    experts = L * E * 3 * d * f
    for tp, dp, ep, etp in ((2, 8, 8, 1), (2, 8, 4, 2), (1, 16, 8, 1), (4, 4, 2, 4)):
        ev = _priced(c, "2x8xH100", tp=tp, dp=dp, ep=ep, etp=etp)
        w, g, o = _state_per_gpu(dense_sharded, replicated, experts, tp, dp, 1, ep, etp)
        mem = ev.rank_memory[0]
        assert mem["weights"] == pytest.approx(w, rel=1e-12)
        assert mem["grads"] == pytest.approx(g, rel=1e-12)
        assert mem["optimizer"] == pytest.approx(o, rel=1e-12)
        assert ev.expert_memory[0]["params"] == pytest.approx(experts / (ep * etp))
        assert ev.expert_memory[0]["optimizer"] == pytest.approx(12 * experts / (ep * etp) / (tp * dp // (ep * etp)))


def test_deepseek_shaped_stage_memory_by_hand():
    # 3 dense layers then 1 MoE layer of 256 routed experts of width 2048 + 1 shared expert, multi-latent attention
    c = costs_of("moe", "deepseek-v3", n_layers=4)
    d, V, heads = 7168, 129280, 128
    q_rank, kv_rank, nope, rope, v = 1536, 512, 128, 64, 128
    E, f, shared_f, dense_f = 256, 2048, 2048, 18432
    mla_linear = d * q_rank + q_rank * heads * (nope + rope) + d * (kv_rank + rope) + kv_rank * heads * (nope + v) + heads * v * d
    mla_norms = q_rank + kv_rank
    dense_sharded = 4 * mla_linear + 3 * 3 * d * dense_f + 3 * d * shared_f + 2 * V * d
    replicated = 4 * (mla_norms + 2 * d) + d * E + d
    experts = E * 3 * d * f
    assert sum(l.params for l in c.layers) == dense_sharded + replicated + experts
    for tp, dp, ep, etp in ((2, 8, 8, 1), (2, 8, 8, 2), (1, 16, 16, 1)):
        ev = _priced(c, "2x8xH100", tp=tp, dp=dp, ep=ep, etp=etp)
        w, g, o = _state_per_gpu(dense_sharded, replicated, experts, tp, dp, 1, ep, etp)
        mem = ev.rank_memory[0]
        assert (mem["weights"], mem["grads"], mem["optimizer"]) == pytest.approx((w, g, o), rel=1e-12)


def test_dispatch_buffers_and_expert_tp_saved_rows_in_closed_form():
    c = costs_of("moe", "deepseek-v3", n_layers=4)
    rows_bytes = 4096 * 8 * 7168 * 2  # s x top-k rows of the hidden width, bf16, one micro-batch
    base = Layout("megatron", 1, 2, 8, 1, 1, 1, 8, "1f1b", "none", 1, True, ep=8, etp=2)
    assert dispatch_buffer_bytes(c, base) == pytest.approx(rows_bytes / 2 * (1 + 2))  # send + received x etp, per GPU
    assert dispatch_buffer_bytes(c, Layout("megatron", 1, 2, 8, 1, 1, 1, 8, "1f1b", "none", 1, True)) == 0.0
    extra = expert_saved_extra(c, 2, 2, "none")
    assert extra[0, c.n] == pytest.approx(rows_bytes / 2 * (2 - 1))  # one MoE layer: the all-gathered input rows
    assert expert_saved_extra(c, 2, 2, "full")[0, c.n] == 0.0 and expert_saved_extra(c, 2, 1, "none")[0, c.n] == 0.0


# ---------------------------------------------------------------- time


def test_expert_gemms_run_one_gemm_per_local_expert_rated_by_its_size():
    dev = hardware.parse_gpus("8xA100").device_of(0)  # the default (Calculon) size curve
    # 128 experts over ep 8: 16 local experts; a grouped GEMM of 64 GFLOP over all rows -> 16 GEMMs of 4 GFLOP each
    # (x ep / (split x experts) = 64e9 x 8 / 128). The default size curve at 4 GFLOP: halfway in log between
    # (1 GFLOP, 0.6/0.95) and (16 GFLOP, 0.9/0.95) = 0.75/0.95 of the device's matmul ceiling
    t = expert_gemm_time((64e9,), 128, 8, 1, dev, "bf16")
    assert t == pytest.approx(16 * 4e9 / (312e12 * A100_MATMUL * 0.75 / 0.95), rel=1e-9)
    # the same FLOPs in 8 large experts are faster: what makes fine-grained experts slow
    assert expert_gemm_time((64e9,), 8, 8, 1, dev, "bf16") < t
    # sequence parallelism over tp = 2 halves the rows a GPU routes
    assert expert_gemm_time((64e9,), 128, 8, 2, dev, "bf16") == pytest.approx(16 * 2e9 / (312e12 * A100_MATMUL * _curve(2e9)), rel=1e-9)


#: the A100 profile's matmul ceiling (efficiency.matmul) times the fraction a training step sustains (efficiency.sustained)
A100_MATMUL = 0.85 * 0.95


def _curve(x):
    """The default matmul size curve written out: linear in log10(x) between (1e9, 0.6/0.95) and (16e9, 0.9/0.95)."""
    return (0.6 + 0.3 * math.log(x / 1e9) / math.log(16)) / 0.95


def test_all_to_all_over_nvlink_and_across_nodes_in_closed_form():
    one = hardware.parse_gpus("8xH100")
    nbytes = 64e6
    assert one.all_to_all_time(nbytes, range(8)) == pytest.approx(nbytes * 7 / 8 / (450e9 * 0.82) + 5e-6)
    two = hardware.parse_gpus("16xH100")
    # 8 members per node: 7/16 of the bytes over NVLink and 8/16 through the GPU's NIC share, at once: the NIC is slower
    assert two.all_to_all_time(nbytes, range(16)) == pytest.approx(max(nbytes * 7 / 16 / (450e9 * 0.82), nbytes * 8 / 16 / (50e9 * 0.94)) + 10e-6)
    # an expert group of 2 ranks 8 apart (etp 8): all of it crosses nodes
    assert two.all_to_all_time(nbytes, [0, 8]) == pytest.approx(nbytes / 2 / (50e9 * 0.94) + 10e-6)
    assert one.all_to_all_time(nbytes, [3]) == 0.0 and one.all_to_all_time(0, range(8)) == 0.0
    # a dispatch with etp 2 adds the all-gather of the rows over the 2 expert-TP GPUs
    d = expert_dispatch_time(one, nbytes, 0, 4, 2)
    assert d == pytest.approx(one.all_to_all_time(nbytes, [0, 2, 4, 6]) + one.all_gather_time(2 * nbytes, [0, 1]))


def test_dispatch_adds_four_transfers_per_moe_piece_and_nothing_to_dense_ones():
    c = costs_of("moe", "deepseek-tiny")
    dev = hardware.parse_gpus("8xH100").device_of(0)
    plain = analytical_times(c, dev, "bf16", experts=(4, 1, 0.0))
    a2a = analytical_times(c, dev, "bf16", experts=(4, 1, 1e-3))
    for l, f0, f1, i0, i1, w0, w1 in zip(c.layers, plain.fwd, a2a.fwd, plain.bwd_input, a2a.bwd_input, plain.bwd_weight, a2a.bwd_weight):
        extra = 2e-3 if l.num_experts else 0.0
        assert (f1 - f0, i1 - i0, w1 - w0) == pytest.approx((extra, extra, 0.0), abs=1e-15)


# ---------------------------------------------------------------- groups and search


@pytest.mark.parametrize("tp,cp,dp,ep,etp", [(1, 1, 16, 8, 1), (2, 1, 8, 4, 2), (2, 2, 4, 8, 1), (4, 1, 4, 2, 4)])
def test_expert_groups_are_megatrons(tp, cp, dp, ep, etp):
    ps = pytest.importorskip("megatron.core.parallel_state")
    pp = 2
    edp = tp * cp * dp // (ep * etp)
    gen = ps.RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp", rank_offset=0)
    block = tp * cp * dp
    mesh = Mesh(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep, etp=etp)
    assert (mesh.block, mesh.expert_data_parallel) == (block, edp)
    ours_ep = sorted(mesh.expert_parallel_group(mesh.first_gpu(r) + e * etp * ep + t) for r in range(pp) for e in range(edp) for t in range(etp))
    ours_dp = sorted(mesh.expert_data_group(mesh.first_gpu(r) + i * etp + t) for r in range(pp) for i in range(ep) for t in range(etp))
    ours_tp = sorted(mesh.expert_tensor_group(mesh.first_gpu(r) + i * etp) for r in range(pp) for i in range(block // etp))
    assert ours_ep == sorted(gen.get_ranks("ep"))
    assert ours_dp == sorted(gen.get_ranks("dp"))
    assert ours_tp == sorted(gen.get_ranks("tp"))


def test_search_enumerates_every_ep_etp_megatron_allows_and_dense_models_get_none():
    c = costs_of("moe", "deepseek-tiny")  # 8 experts
    cluster = hardware.parse_gpus("8xH100")
    lays, _ = enumerate_layouts(c, cluster, Settings.of(engine="megatron"), get_engine("megatron"), 64)
    seen: dict[tuple, set] = {}
    for lay in lays:
        seen.setdefault((lay.tp, lay.cp, lay.dp), set()).add((lay.ep, lay.etp))
    for (tp, cp, dp), pairs in seen.items():
        gpus = tp * cp * dp
        brute = {(e, t) for e in range(1, 65) for t in range(1, 65) if 8 % e == 0 and gpus % (e * t) == 0 and t in (1, tp)}
        assert pairs == brute, (tp, cp, dp)
    assert any(lay.ep == 8 for lay in lays)
    dense = costs_of("llama", "llama-tiny")
    for engine in ("megatron", "deepspeed"):
        lays, _ = enumerate_layouts(dense, cluster, Settings.of(engine=engine), get_engine(engine), 64)
        assert {(x.ep, x.etp) for x in lays} == {(1, 1)}
    lays, _ = enumerate_layouts(c, cluster, Settings.of(engine="deepspeed"), get_engine("deepspeed"), 64)
    assert {(x.ep, x.etp) for x in lays} == {(1, 1)}  # engines without expert parallelism keep ep = etp = 1


def test_pinned_ep_is_what_the_search_prices():
    c = costs_of("moe", "deepseek-tiny")
    res = search(c, hardware.parse_gpus("8xH100"), Settings.of(engine="megatron", ep=4, etp=1, pp=1), get_engine("megatron"))
    assert res.best is not None and {(e.layout.ep, e.layout.etp) for e in res.ranked} == {(4, 1)}
    assert res.best.expert_memory and res.best.expert_memory[0]["params"] == pytest.approx(3 * 8 * 3 * 64 * 32 / 4)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--ep", "0"], "--ep must be a whole number"),
        (["--etp", "-1"], "--etp must be a whole number"),
        (["--ep", "3"], "does not divide the model's 8 experts"),
        (["--ep", "2", "--engine", "deepspeed"], "runs no expert parallelism"),
        (["--overlap-moe-expert-parallel-comm", "--engine", "deepspeed"], "has no --overlap-moe-expert-parallel-comm"),
        (["--overlap-moe-expert-parallel-comm", "--ep", "1"], "--ep 1 runs no expert-parallel all-to-all"),
    ],
)
def test_bad_ep_pins_exit_2(args, needle, tmp_path):
    cmd = ["plan", str(EXAMPLES / "moe.py"), "--model-arg", "preset=deepseek-tiny", "--gpus", "8xH100"]
    if "--engine" not in args:
        cmd += ["--engine", "megatron"]
    r = runner.invoke(app, cmd + args)
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert "Traceback" not in r.output


def test_ep_on_a_dense_model_exits_2():
    r = runner.invoke(app, ["plan", str(EXAMPLES / "llama.py"), "--model-arg", "preset=llama-tiny", "--gpus", "8xH100", "--engine", "megatron", "--ep", "2"])
    assert r.exit_code == 2 and "no routed experts" in r.output
    dense = ["plan", str(EXAMPLES / "llama.py"), "--model-arg", "preset=llama-tiny", "--gpus", "8xH100", "--engine", "megatron"]
    r = runner.invoke(app, dense + ["--overlap-moe-expert-parallel-comm"])
    assert r.exit_code == 2 and "no routed experts" in r.output


def test_engines_without_expert_parallelism_keep_experts_as_dense_weights():
    from dataclasses import replace

    c = costs_of("moe", "deepseek-tiny")
    plain = replace(c, layers=tuple(replace(l, expert_params=0, num_experts=0) for l in c.layers))
    cluster = hardware.parse_gpus("8xH100")
    lay = Layout("deepspeed", 1, 1, 8, 1, 1, 1, 8, "1f1b", "none", 1, False)
    opts = Settings.of(engine="deepspeed", global_batch=8, mem_target=1.0)
    a = price_layout(Context(c, cluster, opts, get_engine("deepspeed")), lay, c.dtype, bounds=(0, c.n))
    b = price_layout(Context(plain, cluster, opts, get_engine("deepspeed")), lay, c.dtype, bounds=(0, c.n))
    for k in ("weights", "grads", "optimizer"):
        assert a.rank_memory[0][k] == pytest.approx(b.rank_memory[0][k], rel=1e-12)
    assert a.predicted.dp_comm_exposed_s == pytest.approx(b.predicted.dp_comm_exposed_s, rel=1e-12)


def test_mixtral_row_dispatch_is_four_nvlink_all_to_alls_per_layer():
    """MLM-mixtral-8x7b (tp 1, ep 8 inside one DGX H100): each of the 32 MoE layers moves, per micro-batch, four times
    the 4096 x 2 routed rows of 4096 bf16 values, 7/8 of them over NVLink at 450 GB/s x 0.82."""
    from bench.published_runs import load_moe_runs, moe_breakdown

    run = next(r for r in load_moe_runs() if r.id == "MLM-mixtral-8x7b")
    row = moe_breakdown(run)
    one = 4096 * 2 * 4096 * 2 * 7 / 8 / (450e9 * 0.82) + 5e-6
    assert row["dispatch"] == pytest.approx(32 * 4 * one * 1e3, rel=1e-9)


def test_plan_and_report_state_ep_and_the_expert_memory(tmp_path):
    import json

    from planner.report import layout_differences

    out = tmp_path / "plan"
    r = runner.invoke(
        app,
        ["plan", str(EXAMPLES / "moe.py"), "--model-arg", "preset=deepseek-tiny", "--gpus", "8xH100", "--engine", "megatron"]
        + ["--ep", "4", "--pp", "1", "--zero", "1", "--out", str(out)],
    )
    assert r.exit_code == 0, r.output
    ex = json.loads((out / "plan.json").read_text())["assumptions"]["experts"]
    per_gpu = 3 * 8 * 3 * 64 * 32 / 4  # 3 MoE layers x 8 experts x (w1, w3, w2 of 64 x 32) over ep 4
    assert (ex["ep"], ex["etp"], ex["expert_data_parallel"], ex["num_experts"], ex["moe_pieces"]) == (4, 1, 2, 8, 3)
    assert ex["params_per_gpu"] == per_gpu
    # bf16 weights (2), fp32 main grads (4), fp32 master + Adam moments (12) over the expert-data-parallel group of 2
    assert ex["bytes_per_gpu"] == {"weights": 2 * per_gpu, "grads": 4 * per_gpu, "optimizer": 12 * per_gpu / 2}
    report = (out / "report.md").read_text()
    assert "split over ep 4 x etp 1 (expert data parallel 2)" in report and "36.9k expert parameters" in report
    assert "token dispatch: alltoall over the ep group, exposed (no --overlap-moe-expert-parallel-comm)." in report
    chosen = Layout("megatron", 1, 1, 8, 1, 1, 1, 8, "1f1b", "none", 1, ep=8)
    assert "ep 4 (chosen 8)" in layout_differences(Layout("megatron", 1, 1, 8, 1, 1, 1, 8, "1f1b", "none", 1, ep=4), chosen)


def test_h800_is_the_h100_sxm_with_nvlink_cut_to_400_gb_s_bidirectional():
    profiles = hardware.available_profiles()
    h800, h100 = profiles["h800"], profiles["h100-sxm"]
    assert h800.peak_flops == h100.peak_flops and h800.memory_bytes == h100.memory_bytes
    assert h800.memory_bandwidth == h100.memory_bandwidth and h800.inter_bandwidth == h100.inter_bandwidth == 50e9
    assert 2 * h800.intra_bandwidth == 400e9 and 2 * h100.intra_bandwidth == 900e9
    # DeepSeek-V3 report 3.2.2: 160 GB/s of NVLink achievable
    assert h800.intra_bandwidth * h800.allreduce_efficiency_intra == pytest.approx(160e9)


def test_tp_collectives_only_where_moe_pieces_have_shared_experts():
    """Megatron's MoE layer with sequence parallelism routes each GPU's 1/tp of the tokens (no residual all-gather);
    shared experts are a tensor-parallel MLP and gather / scatter as a dense MLP does."""
    dev = hardware.parse_gpus("8xH100").device_of(0)
    for preset, shared in (("moe-tiny", False), ("deepseek-tiny", True)):
        c = costs_of("moe", preset)
        free = analytical_times(c, dev, "bf16", tp=2, tp_collective_time=0.0)
        coll = analytical_times(c, dev, "bf16", tp=2, tp_collective_time=1e-3)
        for l, a, b in zip(c.layers, free.fwd, coll.fwd):
            if l.num_experts:
                assert b - a == pytest.approx(1e-3 if shared else 0.0, abs=1e-15), (preset, l.name)
            elif l.kind == "attention":
                assert b - a == pytest.approx(1e-3, abs=1e-15)


def test_expert_dispatch_says_what_the_layout_does():
    """issue: every MoE plan said "token dispatch: alltoall over the ep group, exposed", also at ep 1 (DeepSpeed's
    and torch's only choice: no all-to-all at all) and with --overlap-moe-expert-parallel-comm (hidden)."""
    from planner.planning import expert_dispatch

    base = Layout("megatron", 2, 1, 4, 2, 1, 8, 32, "interleaved", "none", 1, ep=4)
    assert expert_dispatch(base) == "alltoall over the ep group, exposed (no --overlap-moe-expert-parallel-comm)"
    assert expert_dispatch(dataclasses.replace(base, ep_comm_overlap=True)).startswith("alltoall over the ep group, hidden")
    assert expert_dispatch(dataclasses.replace(base, ep=1)).startswith("none: ep 1")
    out = runner.invoke(app, ["plan", str(EXAMPLES / "moe.py"), "--model-arg", "preset=deepseek-tiny", "--gpus", "8xH100", "--engine", "deepspeed", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["assumptions"]["experts"]["dispatch"].startswith("none: ep 1")
    note = next(n for n in doc["notes"] if n.startswith("deepspeed runs no expert parallelism: every GPU of a stage holds all 8 experts"))
    assert note.endswith("--engine megatron shards them over an expert-parallel group (--ep)")


def test_the_no_expert_parallelism_note_names_megatron_only_where_it_can_build_the_model(tmp_path):
    """Megatron builds its model from flags: for an MoE model without a derived shape (no architecture(); transformers'
    gpt-oss, GLM-4.5) the note does not send the user to an engine that refuses it."""
    m = tmp_path / "moe_no_arch.py"
    m.write_text(f"import sys\nsys.path.insert(0, {str(EXAMPLES)!r})\nfrom moe import build_model, example_inputs  # noqa: F401\n")
    out = runner.invoke(app, ["plan", str(m), "--model-arg", "preset=deepseek-tiny", "--gpus", "8xH100", "--engine", "deepspeed", "--json"])
    assert out.exit_code == 0, out.output
    note = next(n for n in json.loads(out.stdout)["notes"] if n.startswith("deepspeed runs no expert parallelism"))
    assert "megatron" not in note
