"""FP8 step time: the FP8 GEMM efficiency from a published GEMM benchmark (the one the BF16 ceiling comes from), Transformer Engine's casts as memory-bound
operators, and the output layer kept in the training dtype (closed forms, independent of the code's own numbers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner import hardware
from planner.hardware import load_profile, matmul_efficiency_at, matmul_time, memory_time, size_scale
from planner.model.analyze import analyze
from planner.solve.timing import analytical_times, attention_core_flops, bytes_time, fp8_cast_bytes, ops_time

ROOT = Path(__file__).resolve().parents[2]

#: stas00/ml-engineering compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table": FP8
#: (float8_e4m3fn) and BF16 MAMF in TFLOP/s and the dense peak each is a share of, per GPU (the BF16 ceilings come from the
#: same table, so both precisions are measured alike); the H800 has no row and takes the H100's (same die and clocks)
FP8_MAMF = {"h100-sxm.yaml": (1402.6, 1979), "h200.yaml": (1453.4, 1979), "h800.yaml": (1402.6, 1979), "b200.yaml": (3432.5, 4500)}
BF16_MAMF = {"h100-sxm.yaml": (794.5, 989), "h200.yaml": (794.5, 989), "h800.yaml": (794.5, 989), "b200.yaml": (1745.0, 2250)}


@pytest.mark.parametrize("name", sorted(FP8_MAMF))
def test_fp8_and_bf16_ceilings_are_the_same_benchmarks_measurements(name):
    p = load_profile(ROOT / "hardware_profiles" / name)
    mamf, peak = FP8_MAMF[name]
    assert p.matmul_fp8_efficiency == pytest.approx(mamf / peak, abs=5e-4)
    assert p.matmul_efficiency == pytest.approx(BF16_MAMF[name][0] / BF16_MAMF[name][1], abs=5e-3)  # two places
    assert p.matmul_fp8_size_scale == ()  # FP8 GEMMs take the matmul size curve
    big = 10**15  # past the size curve's last point: the ceiling itself
    # the benchmark's short-loop rate, before the fraction a training step sustains (efficiency.sustained)
    assert p.flops("fp8") * matmul_efficiency_at(big, p, "fp8") / p.sustained_matmul / 1e12 == pytest.approx(mamf * p.flops("fp8") / 1e12 / peak, rel=1e-3)


def test_fp8_efficiency_applies_to_fp8_only():
    p = load_profile(ROOT / "hardware_profiles" / "h100-sxm.yaml")
    x = 300e9
    assert matmul_efficiency_at(x, p, "bf16") == pytest.approx(p.sustained_matmul * p.matmul_efficiency * size_scale(x, p.matmul_size_scale))
    assert matmul_efficiency_at(x, p) == matmul_efficiency_at(x, p, "bf16")
    assert matmul_time(x, p, "fp8") == pytest.approx(x / (1978.9e12 * p.sustained_matmul * p.matmul_fp8_efficiency * size_scale(x, p.matmul_size_scale)))
    a100 = load_profile(ROOT / "hardware_profiles" / "a100-80gb.yaml")  # no FP8 entry: the matmul ceiling as before
    assert a100.matmul_fp8_efficiency == 0.0
    assert matmul_efficiency_at(x, a100, "fp8") == matmul_efficiency_at(x, a100, "bf16")


def test_fp8_cast_bytes_closed_form():
    t, h, tp = 2048, 1024, 2
    gpt = {"hidden_size": h, "num_attention_heads": 16, "ffn_hidden_size": 4 * h, "activation": "gelu"}
    fwd, bwd = fp8_cast_bytes(gpt, "attention", t, tp)
    assert fwd == [4 * t * h, 4 * t * h / 2]  # QKV input (h), projection input (h / tp)
    assert bwd == [4 * t * 3 * h / 2, 4 * t * h]  # QKV output gradient (3h / tp), projection output gradient (h)
    fwd, bwd = fp8_cast_bytes(gpt, "mlp", t, tp)
    assert fwd == [4 * t * h, 4 * t * 4 * h / 2]
    assert bwd == [4 * t * 4 * h / 2, 4 * t * h]
    # no ffn_hidden_size: Megatron's swiglu default int(8h / 3 / 64) x 64 = 10880
    llama = {"hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8, "activation": "swiglu"}
    fwd, bwd = fp8_cast_bytes(llama, "block", t, 1)
    assert fwd == [4 * t * 4096, 4 * t * 4096, 4 * t * 4096, 4 * t * 10880]
    assert bwd == [4 * t * (4096 + 2 * 1024), 4 * t * 4096, 4 * t * 2 * 10880, 4 * t * 4096]
    assert fp8_cast_bytes(gpt, "head", t, tp) == ([], []) and fp8_cast_bytes(gpt, "embedding", t, tp) == ([], [])


def test_fp8_times_add_the_casts_and_keep_the_output_layer_in_bf16():
    costs = analyze(ROOT / "examples" / "gpt2.py", {"preset": "gpt2-medium"}, 1, "bf16").costs.scaled(4)
    dev = hardware.parse_gpus("8xH100-SXM").device_of(0)
    arch, tokens = costs.architecture, costs.seq_len * 4
    casts = [fp8_cast_bytes(arch, l.kind, tokens, 1) for l in costs.layers]
    kept = [attention_core_flops(arch, l.kind, costs.seq_len, tokens, 1) for l in costs.layers]
    bf = analytical_times(costs, dev, "bf16")
    f8 = analytical_times(costs, dev, "bf16", matmul_dtype="fp8", cast_bytes=casts, kept_flops=kept)
    for k, l in enumerate(costs.layers):
        if l.kind in ("head", "embedding", "norm"):
            assert (f8.fwd[k], f8.bwd_input[k], f8.bwd_weight[k]) == (bf.fwd[k], bf.bwd_input[k], bf.bwd_weight[k]), l.kind
            continue
        mm = ops_time(l.op_flops_fwd, l.flops_fwd, dev, "fp8")
        core = matmul_time(kept[k][0], dev, "bf16") - matmul_time(kept[k][0], dev, "fp8")  # the attention core stays bf16
        want = mm + core + bytes_time(l.op_bytes_fwd + l.op_bytes_fwd_resid, l.mem_bytes_fwd, dev) + sum(memory_time(x, dev, x) for x in casts[k][0])
        assert f8.fwd[k] == pytest.approx(want, rel=1e-12)
        assert sum(casts[k][0]) > 0 and f8.fwd[k] < bf.fwd[k]  # faster GEMMs, but not free casts


def test_hardware_show_lists_the_fp8_ceiling_where_a_profile_has_one():
    from planner.hardware import describe_profile

    h100 = {k: v for k, v, _ in describe_profile(load_profile(ROOT / "hardware_profiles" / "h100-sxm.yaml"))}
    a100 = {k for k, _, _ in describe_profile(load_profile(ROOT / "hardware_profiles" / "a100-80gb.yaml"))}
    assert h100["efficiency.matmul_fp8"].startswith("0.709 ")
    assert "efficiency.matmul_fp8" not in a100


@pytest.mark.parametrize(
    "model,args",
    [
        ("gpt2.py", {"preset": "gpt2-medium"}),
        ("llama.py", {"preset": "llama-7b", "n_layers": 2, "dim": 512, "n_heads": 8, "n_kv_heads": 2, "ffn_dim": 1024, "seq_len": 256, "vocab_size": 512}),
    ],
)
def test_attention_core_flops_are_the_traced_attention_kernel(model, args):
    """The closed form equals the FLOPs torch's FlopCounterMode gives the fused attention operator (one op of the
    attention piece forward, one of its backward), GQA or not."""
    costs = analyze(ROOT / "examples" / model, args, 2, "bf16").costs
    att = next(l for l in costs.layers if l.kind == "attention")
    fwd, bwd = attention_core_flops(costs.architecture, "attention", costs.seq_len, costs.seq_len * 2, 1)
    assert any(x == pytest.approx(fwd, rel=1e-9) for x in att.op_flops_fwd)
    assert any(x == pytest.approx(bwd, rel=1e-9) for x in att.op_flops_bwd)
    assert attention_core_flops(costs.architecture, "mlp", costs.seq_len, costs.seq_len, 1) == (0.0, 0.0)


def test_the_gh100_parts_share_the_h100s_gemm_size_curve_and_sustained_fraction():
    """H200 and H800 are the H100 SXM's die (SMs, clocks): the measured size curve and the sustained fraction fitted on
    top of it are the H100's, so the fit's premise holds for them."""
    h100 = load_profile(ROOT / "hardware_profiles" / "h100-sxm.yaml")
    for name in ("h200.yaml", "h800.yaml"):
        p = load_profile(ROOT / "hardware_profiles" / name)
        assert p.matmul_size_scale == h100.matmul_size_scale and p.sustained_matmul == h100.sustained_matmul, name
