"""Per-piece costs against closed forms and hand counts (issue: foundation)."""

from pathlib import Path

import pytest
import torch

from planner.model.analyze import analyze

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples"


def test_llama7b_forward_flops_match_closed_form(llama7b):
    """2 x matmul params x tokens + 4 s^2 h per layer (attention scores and values, full s^2 as Megatron counts)."""
    a = llama7b.architecture
    h, s, L, ffn, V = a["hidden_size"], a["seq_length"], a["num_layers"], a["ffn_hidden_size"], a["vocab_size"]
    kv = a["num_query_groups"] * h // a["num_attention_heads"]
    matmul_params = L * (2 * h * h + 2 * h * kv + 3 * h * ffn) + h * V
    closed = 2 * matmul_params * s + L * 4 * s * s * h
    total = sum(l.flops_fwd for l in llama7b.layers)
    assert total == pytest.approx(closed, rel=0.01)
    bwd = sum(l.flops_bwd for l in llama7b.layers)
    assert 1.95 < bwd / total < 2.15  # 2x, plus flash attention's recomputation of the scores in backward


def test_llama7b_every_attention_piece_counts_attention(llama7b):
    attn = [l for l in llama7b.layers if l.kind == "attention"]
    assert len(attn) == 32
    h, s = 4096, 4096
    projections = 2 * 4 * h * h * s  # q, k, v, o
    for l in attn:
        assert l.flops_fwd == pytest.approx(projections + 4 * s * s * h, rel=1e-6)


def test_llama7b_pieces_and_cuts(llama7b):
    names = [l.name for l in llama7b.layers]
    assert names[0] == "tok_embeddings" and names[-2:] == ["norm", "output"]
    assert names[1:3] == ["layers.0:attention", "layers.0:feed_forward"]
    assert len(names) == 2 + 2 * 32 + 1
    # only the residual stream crosses every cut: b * s * h bf16
    for cut in llama7b.cuts[1:-1]:
        assert cut.bytes == 4096 * 4096 * 2
    assert {c.kind for c in llama7b.cuts[1:-1]} == {"block", "sub"}


def test_llama7b_params(llama7b):
    assert llama7b.total_params == 6_738_415_616  # Llama-2-7B


def test_gpt2_explicit_attention_saved_bytes_match_korthikanti():
    """Korthikanti et al. 2022: s*b*h*(34 + 5*a*s/h) bytes per GPT layer (explicit attention, GELU MLP, dropout).

    Terms that differ in the example (explained): LayerNorm also saves fp32 mean and rstd per token
    (2 x 2 x 4 = 16 bytes per token and layer), and masked_fill keeps the s x s causal mask (s^2 bytes per layer,
    shared by the batch and heads). Both are under 5%.
    """
    c = analyze(EX / "gpt2.py", {"preset": "gpt2", "attention": "explicit"}, micro_batch=2, dtype="bf16").costs
    s, h, a, b = 1024, 768, 12, 2
    korthikanti = s * b * h * (34 + 5 * a * s / h)
    blocks = {}
    for l in c.layers:
        if l.block:
            blocks[l.block] = blocks.get(l.block, 0) + l.saved_bytes
    assert len(blocks) == 12
    for saved in blocks.values():
        assert saved == pytest.approx(korthikanti, rel=0.05)
        extra = 2 * 2 * 4 * s * b + s * s
        assert saved == pytest.approx(korthikanti + extra, rel=0.002)
    # the attention core: softmax output + dropout mask + dropped probabilities = 5 a s^2 b bytes
    attn = next(l for l in c.layers if l.kind == "attention")
    assert attn.core_saved_bytes == 5 * a * s * s * b


def test_costs_scale_linearly_with_micro_batch():
    one = analyze(EX / "gpt2.py", {"preset": "gpt2-tiny"}, micro_batch=1, dtype="fp32").costs
    three = analyze(EX / "gpt2.py", {"preset": "gpt2-tiny"}, micro_batch=3, dtype="fp32").costs
    scaled = one.scaled(3)
    total_saved = sum(l.saved_bytes for l in three.layers)
    for x, y in zip(three.layers, scaled.layers):
        assert x.flops_fwd == pytest.approx(y.flops_fwd, rel=1e-9)
        assert x.flops_bwd == pytest.approx(y.flops_bwd, rel=1e-9)
        # tensors that do not grow with the batch (position ids, masks) scale too: a few hundred bytes
        assert abs(x.saved_bytes - y.saved_bytes) <= 0.01 * total_saved
    for x, y in zip(three.cuts, scaled.cuts):
        assert x.bytes == y.bytes
        assert [t.shape for t in x.tensors] == [t.shape for t in y.tensors]


def test_resnet_skip_connections_add_to_cut_bytes():
    """ResNet-FPN: the stage outputs c2, c3, c4 jump over every cut before the head reads them.

    Hand count for resnet-tiny (width 8, image 64, micro-batch 2, fp32): after the stem the map is
    8 x 16 x 16; layer1 keeps it, layer2 halves the side and doubles channels, and so on.
    """
    c = analyze(EX / "resnet.py", {"preset": "resnet-tiny", "head": "fpn"}, micro_batch=2, dtype="fp32").costs
    names = [l.name for l in c.layers]
    assert names[:5] == ["conv1+bn1+maxpool", "layer1.0", "layer2.0", "layer3.0", "layer4.0"]
    b, f = 2, 4
    c2 = b * 8 * 16 * 16 * f
    c3 = b * 16 * 8 * 8 * f
    c4 = b * 32 * 4 * 4 * f
    c5 = b * 64 * 2 * 2 * f
    assert c.cuts[2].bytes == c2  # between layer1 and layer2: only c2
    assert c.cuts[3].bytes == c2 + c3  # c2 skips over layer2 -> layer3
    assert c.cuts[4].bytes == c2 + c3 + c4
    assert c.cuts[5].bytes == c2 + c3 + c4 + c5
    assert len(c.cuts[4].tensors) == 3


def test_meta_device_allocates_nothing():
    """Planning a 70B model must not allocate its weights: every parameter stays on meta."""
    from planner.model.load import load_model_file

    mf = load_model_file(EX / "llama.py", {"preset": "llama-70b"})
    model = mf.build_meta(torch.bfloat16)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 68_976_648_192


def test_tied_head_is_counted_once():
    c = analyze(EX / "gpt2.py", {"preset": "gpt2"}, micro_batch=1, dtype="bf16").costs
    assert [g.layers for g in c.tied] == [(0, c.n - 1)]
    assert c.total_params == 124_439_808  # GPT-2 small with 1024 positions


def test_repeated_blocks_are_costed_once(monkeypatch):
    """Identical blocks share a structural signature: cost_piece runs once per distinct piece, not per block."""
    import planner.model.cost as cost

    calls = []
    real = cost.cost_piece
    monkeypatch.setattr(cost, "cost_piece", lambda *a, **k: calls.append(1) or real(*a, **k))
    c = analyze(EX / "llama.py", {"preset": "llama-tiny"}, 1, "fp32").costs
    # embedding, attention, feed-forward, norm, head: 5 distinct of 11 pieces
    assert c.n == 11 and len(calls) == 5
    attn = [l for l in c.layers if l.kind == "attention"]
    assert len({(l.flops_fwd, l.saved_bytes) for l in attn}) == 1
