"""The bytes the memory-bound kernels of Megatron's own layer move, checked kernel by kernel against the kernels
themselves run on CPU (megatron-core's fused bias-GeLU, bias-SwiGLU and bias-dropout-add, torch's single-kernel norms,
the query reshape of get_query_key_value_tensors), and the engine hook: Megatron's plans time the blocks with these
bytes, the other engines with the traced ones."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from planner import hardware
from planner.engines import get_engine
from planner.engines.megatron.activations import STAT_BYTES, LayerShape
from planner.engines.megatron.rules import megatron_layer_traffic
from planner.engines.megatron.traffic import Kernel, layer_traffic, part_traffic
from planner.solve.search import Context
from planner.solve.settings import Settings

S, B, H, HEADS, GROUPS, FFN = 16, 2, 64, 8, 2, 96
D = 2.0  # bf16


def _shape(**kw):
    arch = {"hidden_size": H, "num_attention_heads": HEADS, "num_query_groups": GROUPS, "ffn_hidden_size": FFN, "normalization": "RMSNorm"}
    arch.update({"activation": "swiglu", "dropout": 0.0, **kw})
    return LayerShape.from_architecture(arch)


def _kernel(kernels: tuple[Kernel, ...], name: str) -> Kernel:
    return next(k for k in kernels if k.name == name)


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.untyped_storage().nbytes() if t.is_contiguous() else t.numel() * t.element_size() for t in ts)


def test_rmsnorm_forward_and_backward_read_and_write_the_norm_term():
    """torch's fused RMSNorm call (aten._fused_rms_norm, its backward) reads and writes the norm term: x in, y and the
    fp32 1/sigma out, 2 R d + 4 per token, forward; g, x and 1/sigma in, dx out, 3 R d + 4 per token, backward (plus
    the weight and its gradient, h elements, which the closed form leaves out)."""
    r = S * B * H
    x = torch.randn(S, B, H, dtype=torch.bfloat16)
    w = torch.ones(H, dtype=torch.bfloat16)
    y, rstd = torch.ops.aten._fused_rms_norm(x, [H], w, 1e-5)
    assert rstd.dtype == torch.float32 and rstd.numel() == S * B
    k = _kernel(layer_traffic(_shape(), S, B), "attention norm")
    assert _nbytes(x, y, rstd) == k.fwd == 2 * D * r + STAT_BYTES * S * B
    # the backward kernel's own signature (it has no CPU kernel to run): grad_out, input, rstd (and the weight) in,
    # the input's and the weight's gradients out
    schema = torch.ops.aten._fused_rms_norm_backward.default._schema
    assert [a.name for a in schema.arguments if str(a.type) == "Tensor"] == ["grad_out", "input", "rstd"]
    assert len(schema.returns) == 2
    g, dx = torch.empty_like(y), torch.empty_like(x)
    assert _nbytes(g, x, rstd, dx) == k.bwd == 3 * D * r + STAT_BYTES * S * B


def test_layernorm_statistics_are_two_per_token():
    """LayerNorm keeps mean and 1/sigma: its norm kernel moves one statistic per token more than RMSNorm's."""
    ln = _kernel(layer_traffic(_shape(normalization="LayerNorm"), S, B), "mlp norm")
    rms = _kernel(layer_traffic(_shape(), S, B), "mlp norm")
    assert ln.fwd - rms.fwd == ln.bwd - rms.bwd == STAT_BYTES * S * B
    x = torch.randn(S, B, H, dtype=torch.float32)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [H], None, None, 1e-5)
    assert mean.numel() == rstd.numel() == S * B


@pytest.mark.parametrize("tp", [1, 4])
def test_bias_swiglu_is_megatrons_fused_function(tp):
    """megatron-core's bias_swiglu_impl (fusions/fused_bias_swiglu.py) reads FC1's 2F-wide output and writes F forward;
    its backward reads the gradient (F) and the saved input (2F) and writes the input gradient (2F), which autograd
    then sums over the tokens for FC1's bias (2F read)."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    f = FFN // tp
    y = torch.randn(S, B, 2 * f, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.zeros(2 * f, dtype=torch.bfloat16, requires_grad=True)
    out = bias_swiglu_impl(y, bias)
    k = _kernel(layer_traffic(_shape(), S, B, tp), "bias-swiglu")
    assert _nbytes(y) + _nbytes(out) == k.fwd
    g = torch.randn_like(out)
    (dy,) = torch.autograd.grad(out, [y], g, retain_graph=True)
    assert _nbytes(g) + _nbytes(y) + _nbytes(dy) + _nbytes(dy) == k.bwd  # the bias gradient reads dy again


def test_bias_gelu_is_megatrons_fused_function():
    """megatron-core's GeLUFunction (fusions/fused_bias_gelu.py) reads F and writes F forward; backward reads the
    gradient and the saved input, writes one tensor that is both the input's and (summed over tokens) the bias's."""
    from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl

    shape = _shape(activation="gelu", normalization="LayerNorm", num_query_groups=None, ffn_hidden_size=4 * H)
    y = torch.randn(S, B, 4 * H, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.zeros(4 * H, dtype=torch.bfloat16, requires_grad=True)
    out = bias_gelu_impl(y, bias)
    k = _kernel(layer_traffic(shape, S, B, bias=True), "bias-gelu")
    assert _nbytes(y) + _nbytes(out) == k.fwd
    dy, db = torch.autograd.grad(out, [y, bias], torch.randn_like(out))
    assert db.shape == bias.shape
    assert 3 * _nbytes(dy) + _nbytes(dy) == k.bwd  # g, y -> dy; the bias reduction reads dy
    assert _kernel(layer_traffic(shape, S, B, bias=False), "bias-gelu").bwd == 3 * _nbytes(dy)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_bias_dropout_add_is_megatrons_fused_function(dropout):
    """megatron-core's bias_dropout_add_fused_train reads the projection's output and the residual and writes their
    sum (and a 1-byte mask with dropout); at p = 0 the backward passes the gradient on (no kernel) and only the bias's
    reduction reads it."""
    from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train

    x = torch.randn(S, B, H, dtype=torch.bfloat16, requires_grad=True)
    res = torch.randn(S, B, H, dtype=torch.bfloat16, requires_grad=True)
    out = bias_dropout_add_fused_train((x, None), res, dropout)
    k = _kernel(layer_traffic(_shape(dropout=dropout), S, B, bias=False), "attention bias-dropout-add")
    mask = S * B * H if dropout else 0
    assert _nbytes(x) + _nbytes(res) + _nbytes(out) + mask == k.fwd
    if dropout == 0:
        assert k.bwd == 0
        g = torch.randn_like(out)
        dx, dres = torch.autograd.grad(out, [x, res], g)
        assert torch.equal(dx, g) and torch.equal(dres, g)
    else:
        assert k.bwd == 2 * _nbytes(x) + mask  # g and the mask read, dx written
    with_bias = _kernel(layer_traffic(_shape(dropout=dropout), S, B, bias=True), "attention bias-dropout-add")
    assert with_bias.bwd - k.bwd == _nbytes(x)


@pytest.mark.parametrize(("groups", "copies"), [(GROUPS, True), (HEADS, False)])
def test_query_reshape_copies_with_query_groups(groups, copies):
    """get_query_key_value_tensors (megatron/core/transformer/attention.py) splits the QKV output
    [s, b, groups, (heads / groups + 2) x head] and reshapes the query to [s, b, heads, head]: a copy with query groups,
    a view without; the closed form has the copy's 2 Q bytes exactly then."""
    hn = H // HEADS
    per = HEADS // groups
    mixed = torch.randn(S, B, groups, (per + 2) * hn, dtype=torch.bfloat16)
    query, _, _ = torch.split(mixed, [per * hn, hn, hn], dim=3)
    q = query.reshape(S, B, -1, hn)
    assert (q.untyped_storage().data_ptr() != mixed.untyped_storage().data_ptr()) is copies
    names = {k.name for k in layer_traffic(_shape(num_query_groups=groups), S, B)}
    assert ("query reshape copy" in names) is copies
    if copies:
        assert _kernel(layer_traffic(_shape(num_query_groups=groups), S, B), "query reshape copy").fwd == 2 * _nbytes(q)


def test_sequence_parallelism_splits_the_residual_stream_only():
    """Under tp with sequence parallelism the norms and bias-dropout-adds work on 1/tp of the tokens; without it they
    are replicated; the MLP activation is split over tp either way."""
    full = layer_traffic(_shape(), S, B, tp=4, sequence_parallel=False)
    sp = layer_traffic(_shape(), S, B, tp=4, sequence_parallel=True)
    assert _kernel(sp, "mlp norm").fwd == pytest.approx(_kernel(full, "mlp norm").fwd / 4)
    assert _kernel(sp, "bias-swiglu").fwd == _kernel(full, "bias-swiglu").fwd == 3 * D * S * B * FFN / 4


def test_rope_and_qk_norms_move_q_and_k():
    """Fused RoPE reads and writes q and k (2 (Q + K) each way); q/k norms likewise forward, 3 (Q + K) backward."""
    q, kv = S * B * H, S * B * H * GROUPS / HEADS
    ks = layer_traffic(_shape(), S, B, rotary=True, qk_norm=True)
    assert _kernel(ks, "rope").fwd == _kernel(ks, "rope").bwd == 2 * D * (q + kv)
    assert _kernel(ks, "q/k norms").bwd == 3 * D * (q + kv)
    assert "rope" not in {k.name for k in layer_traffic(_shape(), S, B)}
    fwd, bwd = part_traffic(ks, "attention")
    assert len(fwd) == 5 and len(bwd) == 6  # norm, rope, copy, q/k norms, bda | + gradient sum and qkv concatenation


@pytest.fixture(scope="module")
def tiny():
    from tests.conftest import costs_of

    return costs_of("llama", "llama-tiny")


def _ctx(costs, engine):
    return Context(costs, hardware.parse_gpus("2xH100-SXM"), Settings.of(engine=engine, global_batch=8, mem_target=1.0), get_engine(engine))


def test_megatron_times_its_own_layer_and_other_engines_the_traced_one(tiny):
    """llama-tiny under Megatron: every block's memory-bound bytes are the closed form's (RMSNorm, SwiGLU, rope, query
    groups, no bias, no dropout), in its attention and MLP pieces; the embedding and head as traced. Under DeepSpeed and
    torch the hook returns the costs it is given and the piece times are the traced ones."""
    ctx = _ctx(tiny, "megatron")
    sharded = ctx.sharded(1, 1)
    timed = megatron_layer_traffic(sharded, 1, False, 1)
    a = tiny.architecture
    kernels = layer_traffic(LayerShape.from_architecture(a), tiny.seq_len, 1, rotary=True, bias=False)
    fwd = sum(k.fwd for k in kernels)
    bwd = sum(k.bwd for k in kernels)
    blocks = [k for k, l in enumerate(tiny.layers) if l.block is not None]
    assert sum(timed.layers[k].mem_bytes_fwd for k in blocks) == pytest.approx(a["num_layers"] * fwd)
    assert sum(timed.layers[k].mem_bytes_bwd for k in blocks) == pytest.approx(a["num_layers"] * bwd)
    for k, l in enumerate(timed.layers):
        if k not in blocks:
            assert l == sharded.layers[k]
    t_meg = ctx.times(1, 1, "none", 0, "bf16")
    for engine in ("deepspeed", "torch"):
        other = _ctx(tiny, engine)
        assert get_engine(engine).layer_traffic(sharded, 1, False, 1) is sharded
        t = other.times(1, 1, "none", 0, "bf16")
        assert t.fwd != t_meg.fwd
    # the traced llama example moves several times what Megatron's layer does
    traced = sum(sharded.layers[k].mem_bytes_fwd for k in blocks)
    assert traced > 2 * a["num_layers"] * fwd


def test_megatron_traffic_leaves_layers_it_does_not_build_as_traced(tiny):
    """Experts, multi-latent attention, a block count not num_layers, or explicit (s x s) attention: traced bytes."""
    for arch in ({"num_experts": 8}, {"multi_latent_attention": True}, {"num_layers": 3}):
        c = replace(tiny, architecture={**tiny.architecture, **arch})
        assert megatron_layer_traffic(c, 1, False, 1) is c
    blocks = [k for k, l in enumerate(tiny.layers) if l.block is not None]
    layers = list(tiny.layers)
    layers[blocks[0]] = replace(layers[blocks[0]], core_bytes_fwd=1.0)
    explicit = replace(tiny, layers=tuple(layers))
    assert megatron_layer_traffic(explicit, 1, False, 1) is explicit


class _AtenBytes:
    """Bytes each aten op reads (tensor arguments) and writes (tensor results) while it runs, as a torch dispatch mode."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        log = self.ops = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func.overloadpacket not in (torch.ops.aten.detach, torch.ops.aten.ones_like):  # views and the seed gradient
                    outs = out if isinstance(out, tuple) else (out,)
                    log.append((func.overloadpacket.__name__, sum(_nbytes(a) for a in args if isinstance(a, torch.Tensor)) + _nbytes(*outs)))
                return out

        self.mode = Mode()


def test_squared_relu_is_megatrons_unfused_function():
    """megatron-core's squared_relu (activations.py, never fused): relu then pow forward, reading and writing F each;
    backward the four aten ops torch's autograd dispatches for them (pow, mul by 2, mul by the gradient,
    threshold_backward), 10 F in all; with a bias its add forward (reads F and the bias, writes F) and its gradient's
    reduction (F)."""
    from megatron.core.activations import squared_relu

    shape = _shape(activation="squared_relu", ffn_hidden_size=FFN)
    assert not shape.swiglu
    y = torch.randn(S, B, FFN, dtype=torch.bfloat16, requires_grad=True)
    fwd, bwd = _AtenBytes(), _AtenBytes()
    with fwd.mode:
        out = squared_relu(y)
    g = torch.randn_like(out)
    with bwd.mode:
        out.backward(g)
    k = _kernel(layer_traffic(shape, S, B, bias=False), "squared relu")
    assert [n for n, _ in fwd.ops] == ["relu", "pow"] and sum(b for _, b in fwd.ops) == k.fwd == 4 * _nbytes(y)
    assert sorted(n for n, _ in bwd.ops) == ["mul", "mul", "pow", "threshold_backward"]
    assert sum(b for _, b in bwd.ops) == k.bwd == 10 * _nbytes(y)
    biased = _kernel(layer_traffic(shape, S, B, bias=True), "squared relu")
    bias = torch.zeros(FFN, dtype=torch.bfloat16, requires_grad=True)
    add = _AtenBytes()
    with add.mode:
        z = y + bias
    assert (biased.fwd - k.fwd, biased.bwd - k.bwd) == (sum(b for _, b in add.ops) - _nbytes(bias), _nbytes(z))
