"""The published mixture-of-experts runs (bench/data/published_moe_runs.yaml) on their own.

Layouts that multiply out and expert groups Megatron can build; converted step times re-derived from what each
source published, by each source's own counting written out here as forward multiply-adds x 2 x 3 passes from the
models' published configurations (config.json values below, independent of bench/published_runs.py and of
examples/moe.py); the source's second figure reproduced from the first (tokens/s against TFLOP/s: this pins the
shapes, MTP included, and the formula); and the examples/moe.py presets the rows use equal those configurations.
Until the planner has expert parallelism every row is reported as not expressible, not dropped."""

import math

import pytest
import yaml

from bench import published_runs as pr

RAW = yaml.safe_load(pr.MOE_DATA.read_text())
ROWS = RAW["runs"]
SOURCES = RAW["sources"]
MODELS = RAW["models"]

#: the models' published configurations (Hugging Face config.json of each: mistralai/Mixtral-8x7B-v0.1,
#: Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, deepseek-ai/DeepSeek-V3)
CONFIG = {
    "mixtral-8x7b": dict(layers=32, h=4096, heads=32, kv=8, head_dim=128, experts=8, topk=2, moe_ffn=14336, vocab=32000),
    "qwen3-30b-a3b": dict(layers=48, h=2048, heads=32, kv=4, head_dim=128, experts=128, topk=8, moe_ffn=768, vocab=151936),
    "qwen3-235b-a22b": dict(layers=94, h=4096, heads=64, kv=4, head_dim=128, experts=128, topk=8, moe_ffn=1536, vocab=151936),
    "deepseek-v3": dict(
        layers=61,
        h=7168,
        heads=128,
        dense=3,
        ffn=18432,
        experts=256,
        topk=8,
        moe_ffn=2048,
        shared=2048,
        vocab=129280,
        q_rank=1536,
        kv_rank=512,
        nope=128,
        rope=64,
        v=128,
    ),
}


def _cfg(row) -> dict:
    return CONFIG[MODELS[row["model"]]["preset"]]


def _padded(vocab: int, tp: int) -> int:
    return math.ceil(vocab / (128 * tp)) * 128 * tp


def _macs_attention_gqa(c, s, causal_half: bool) -> float:
    """Multiply-adds per token of one GQA layer: q, k, v, o projections and the two s-long products (halved if causal)."""
    q, kv = c["heads"] * c["head_dim"], c["kv"] * c["head_dim"]
    core = 2 * q * s * (0.5 if causal_half else 1.0)
    return c["h"] * q + 2 * c["h"] * kv + q * c["h"] + core


def _macs_attention_mla(c, s) -> float:
    """MLA per token: q down/up, kv down (latent + shared rope key) and up, o, the q and kv norms as Bridge counts them
    (one per element), causal products halved."""
    H, h = c["heads"], c["h"]
    q = h * c["q_rank"] + c["q_rank"] + c["q_rank"] * H * (c["nope"] + c["rope"])
    kv = h * (c["kv_rank"] + c["rope"]) + c["kv_rank"] + c["kv_rank"] * H * (c["nope"] + c["v"])
    core = s / 2 * H * (c["nope"] + c["rope"]) + s / 2 * H * c["v"]
    return q + kv + H * c["v"] * h + core


def bridge_flops_per_token(row) -> float:
    """3 passes x 2 FLOPs x multiply-adds: attention, SwiGLU MLPs (3 GEMMs) for dense layers and top-k + shared
    experts, MTP layers (one more MoE layer, its 2h x h projection and 3 norms, its own logits), padded logits."""
    c, s, mtp = _cfg(row), MODELS[row["model"]]["seq"], MODELS[row["model"]].get("mtp_layers", 0)
    h = c["h"]
    attention = _macs_attention_mla(c, s) if "q_rank" in c else _macs_attention_gqa(c, s, causal_half=True)
    dense = c.get("dense", 0)
    moe_layers = c["layers"] - dense + mtp
    mlp = 3 * h * (c.get("ffn", 0) * dense + (c["moe_ffn"] * c["topk"] + c.get("shared", 0)) * moe_layers)
    macs = (c["layers"] + mtp) * attention + mlp + mtp * (2 * h * h + 3 * h) + (1 + mtp) * h * _padded(c["vocab"], row["tp"])
    return 3 * 2 * macs


def megatron09_flops_per_token(row) -> float:
    """Megatron-Core 0.9: the same with causal attention counted in full, no MTP, every layer MoE, vocabulary padded to 128."""
    c, s = _cfg(row), MODELS[row["model"]]["seq"]
    h = c["h"]
    macs = c["layers"] * (_macs_attention_gqa(c, s, causal_half=False) + 3 * h * c["moe_ffn"] * c["topk"]) + h * _padded(c["vocab"], 1)
    return 3 * 2 * macs


def _tokens(row) -> int:
    return row["global_batch"] * MODELS[row["model"]]["seq"]


def _step_from_published(row) -> float:
    rep, how = row["reported"], SOURCES[row["source"]]["step_from"]
    if how == "tokens":
        return _tokens(row) / (rep["tokens"] * row["gpus"])
    if how == "tflops":
        return _tokens(row) * megatron09_flops_per_token(row) / (rep["tflops"] * 1e12 * row["gpus"])
    assert how == "gpu_hours"
    gpu_seconds_per_token = rep["gpu_hours_per_trillion_tokens"] * 3600 / 1e12
    return _tokens(row) * gpu_seconds_per_token / row["gpus"]


IDS = [r["id"] for r in ROWS]


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_layout_multiplies_out_and_the_expert_groups_fit(row):
    """world = tp pp cp dp; with MoE parallel folding the expert groups (etp x ep) tile tp x cp x dp, and ep divides the experts."""
    assert row["tp"] * row["pp"] * row["dp"] * row.get("cp", 1) == row["gpus"]
    assert (row["tp"] * row.get("cp", 1) * row["dp"]) % (row["etp"] * row["ep"]) == 0
    assert _cfg(row)["experts"] % row["ep"] == 0
    assert row["tp"] == 1 or row.get("sequence_parallel"), "Megatron needs sequence parallelism with MoE and tp > 1"


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_global_batch_divides_into_micro_batches(row):
    m, rem = divmod(row["global_batch"], row["micro_batch"] * row["dp"])
    assert rem == 0 and m >= 1


@pytest.mark.parametrize("row", [r for r in ROWS if r.get("vp", 1) > 1], ids=lambda r: r["id"])
def test_interleaved_rows_split_into_whole_chunks(row):
    """layers / (pp x vp) whole, or with embedding and loss counted as a layer each (and the MTP layer) as Bridge's layouts do."""
    chunks, layers = row["pp"] * row["vp"], _cfg(row)["layers"]
    assert layers % chunks == 0 or (layers + 2 + MODELS[row["model"]].get("mtp_layers", 0)) % chunks == 0


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_converted_step_time_reproduces_the_published_figure(row):
    assert row["step_s"] == pytest.approx(_step_from_published(row), rel=6e-4)
    run = next(r for r in pr.load_moe_runs() if r.id == row["id"])
    assert pr.converted_step_s(run) == pytest.approx(row["step_s"], rel=6e-4)  # the bench's conversion agrees


@pytest.mark.parametrize("row", [r for r in ROWS if SOURCES[r["source"]]["flop_formula"] == "bridge_moe"], ids=lambda r: r["id"])
def test_bridge_tflops_follow_from_its_tokens_per_second(row):
    """Bridge prints tokens/s and TFLOP/s: its FLOP count per token links them within 1% on every row."""
    tflops = row["reported"]["tokens"] * bridge_flops_per_token(row) / 1e12
    assert tflops == pytest.approx(row["reported"]["tflops"], rel=0.01)
    run = next(r for r in pr.load_moe_runs() if r.id == row["id"])
    assert pr.step_flops(run) / _tokens(row) == pytest.approx(bridge_flops_per_token(row), rel=1e-9)


def test_deepseek_gpu_hours_give_the_published_days():
    row = next(r for r in ROWS if r["source"] == "deepseek_v3")
    rep = row["reported"]
    assert round(rep["gpu_hours_per_trillion_tokens"] / row["gpus"] / 24, 1) == rep["days_per_trillion_tokens"]


def test_megatron_count_is_the_bench_formula():
    row = next(r for r in ROWS if r["source"] == "megatron_moe_readme")
    run = next(r for r in pr.load_moe_runs() if r.id == row["id"])
    assert pr.step_flops(run) == pytest.approx(_tokens(row) * megatron09_flops_per_token(row), rel=1e-12)


@pytest.mark.parametrize("name", list(CONFIG))
def test_example_presets_are_the_published_configurations(name):
    c = CONFIG[name]
    p = pr._moe_module()._config(name)
    assert (p["n_layers"], p["dim"], p["n_heads"], p["num_experts"], p["top_k"], p["moe_ffn_dim"], p["vocab_size"]) == (
        c["layers"],
        c["h"],
        c["heads"],
        c["experts"],
        c["topk"],
        c["moe_ffn"],
        c["vocab"],
    )
    if "q_rank" in c:
        assert (p["attention"], p["first_k_dense"], p["ffn_dim"], p["n_shared_experts"] * p["shared_ffn_dim"]) == ("mla", c["dense"], c["ffn"], c["shared"])
        assert (p["q_lora_rank"], p["kv_lora_rank"], p["qk_nope_head_dim"], p["qk_rope_head_dim"], p["v_head_dim"]) == (
            c["q_rank"],
            c["kv_rank"],
            c["nope"],
            c["rope"],
            c["v"],
        )
    else:
        assert (p["attention"], p["n_kv_heads"], p["head_dim"], p["first_k_dense"], p["n_shared_experts"]) == ("gqa", c["kv"], c["head_dim"], 0, 0)


def test_sources_rows_and_split():
    """At least 4 rows on H100/B200 from at least 2 independent organisations' sources; every MoE source test-only."""
    assert all(s["split"] == "test" for s in SOURCES.values())
    assert sum(SOURCES[r["source"]]["device"] in ("H100-SXM", "B200") for r in ROWS) >= 4
    assert {"megatron_moe_readme", "deepseek_v3"} <= {r["source"] for r in ROWS} and any(r["source"].startswith("bridge") for r in ROWS)
    assert len({r["id"] for r in ROWS}) == len(ROWS)
    for row in ROWS:
        assert row["source"] in SOURCES and row["model"] in MODELS
        assert row["dispatcher"] in ("alltoall", "allgather", "flex") and row["precision"] in ("bf16", "fp8", "mxfp8")


def test_rows_load_with_the_example_model_and_carry_ep():
    runs = {r.id: r for r in pr.load_moe_runs()}
    assert len(runs) == len(ROWS)
    assert all(r in pr.RUNS_ALL for r in runs.values())
    r = runs["B26-qwen3-235b-h100"]
    path, args = pr.model_file(r)
    assert path == pr.MOE_MODEL and args == {"preset": "qwen3-235b-a22b", "seq_len": 4096}
    assert (r.ep, r.etp, r.dispatcher, r.model.arch, r.model.layers) == (32, 1, "alltoall", "moe", 94)
    lay = pr.layout_for(runs["B26-qwen3-30b-b200"])
    assert lay.fp8 and (lay.tp, lay.pp, lay.dp) == (1, 1, 8)
    if pr._planner_has_ep():
        assert lay.ep == 8
    assert pr.not_expressible(runs["DSV3-2048-h800"]) is None  # hardware_profiles/h800.yaml


@pytest.mark.skipif(pr._planner_has_ep(), reason="the planner has expert parallelism: the rows are priced")
def test_without_expert_parallelism_rows_are_reported_not_dropped():
    preds = [pr.predict(r) for r in pr.load_moe_runs()]
    assert all(p.predicted_step_s is None and "expert parallelism" in p.skipped for p in preds)
    table = pr.markdown(preds)
    assert table.count("not expressible: needs") == len(ROWS) and "ep 32" in table


def test_ep_comm_overlap_is_the_rows_recipe_setting():
    """A row whose `overlap` names ep_comm (its recipe's moe_a2a_overlap / overlap_moe_expert_parallel_comm) gets
    Layout.ep_comm_overlap where Megatron allows it (ep > 1, vp with pp > 1, no full recomputation), and only then;
    the other overlaps map as before (Qwen3-235B on H100 runs without --tp-comm-overlap)."""
    import dataclasses

    runs = {r.id: r for r in pr.load_moe_runs()}
    on = {"B26-qwen3-30b-h100", "B26-qwen3-235b-h100", "B25-qwen3-30b-h100", "B25-qwen3-235b-h100", "B25-deepseek-v3-h100"}
    assert {k for k, r in runs.items() if "ep_comm" in r.overlap} == on
    for k, r in runs.items():
        assert pr.layout_for(r).ep_comm_overlap == (k in on), k
    r = runs["B26-qwen3-235b-h100"]
    lay = pr.layout_for(r)
    assert not lay.tp_comm_overlap and lay.overlap_grad_reduce and lay.overlap_param_gather
    assert "overlap-moe-expert-parallel-comm" in lay.overlaps
    # Megatron refuses the overlap with pp > 1 and no virtual stages, and with full recomputation: the row keeps it off
    assert not pr.layout_for(dataclasses.replace(r, vp=1)).ep_comm_overlap
    assert not pr.layout_for(r, recompute="full").ep_comm_overlap
    # the 25.09 DeepSeek-V3 recipe turns the gradient-reduce overlap off on H100 (param gather alone is not a Megatron-LM layout)
    ds = pr.layout_for(runs["B25-deepseek-v3-h100"])
    assert ds.ep_comm_overlap and not ds.overlap_grad_reduce and not ds.overlap_param_gather
    # every Bridge recipe reduces gradients in bf16 (grad_reduce_in_fp32 False) with FP8 primary weights (fp8_cs / fp8_mx)
    for k, r in runs.items():
        if r.source.key.startswith("bridge"):
            lay = pr.layout_for(r)
            assert (lay.main_grads_dtype, lay.fp8_param_gather, lay.fp8) == ("bf16", True, True), k
