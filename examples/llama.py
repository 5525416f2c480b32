"""Llama style decoder (RMSNorm, SwiGLU, rotary positions, grouped-query attention, untied head).

A model file for `planner`. Pick a size with ``--model-arg preset=NAME`` (see
PRESETS) and override fields, e.g. ``--model-arg seq_len=8192``. The shapes
are those of the published Llama 2 (7B, 70B) and Llama 3.1 (405B) models.
``--model-arg activation=squared_relu`` swaps the gated SwiGLU MLP for the
ungated squared-ReLU one of Nemotron-4 (``w2(relu(w1 x) ** 2)``, Megatron's
``--squared-relu``).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {
    # name: layers, hidden, heads, kv heads, ffn, seq, vocab
    "llama-tiny": dict(n_layers=4, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=176, seq_len=32, vocab_size=256),
    "llama-1b": dict(n_layers=16, dim=2048, n_heads=32, n_kv_heads=8, ffn_dim=8192, seq_len=4096, vocab_size=128256),
    "llama-7b": dict(n_layers=32, dim=4096, n_heads=32, n_kv_heads=32, ffn_dim=11008, seq_len=4096, vocab_size=32000),
    "llama-13b": dict(n_layers=40, dim=5120, n_heads=40, n_kv_heads=40, ffn_dim=13824, seq_len=4096, vocab_size=32000),
    "llama-70b": dict(n_layers=80, dim=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672, seq_len=4096, vocab_size=32000),
    "llama-405b": dict(n_layers=126, dim=16384, n_heads=128, n_kv_heads=8, ffn_dim=53248, seq_len=8192, vocab_size=128256),
}


def _config(preset="llama-7b", **overrides):
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    cfg = dict(PRESETS[preset])
    cfg.update({k: int(v) for k, v in overrides.items() if v is not None})
    return cfg


def rope_tables(head_dim, seq_len, theta=10000.0):
    """cos and sin tables, each (seq_len, head_dim // 2), float32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rope(x, rope):
    """Rotate (b, heads, s, d) by the first s rows of the tables."""
    s = x.size(2)
    cos, sin = rope[0, :s].to(x.dtype), rope[1, :s].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, rope):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:  # grouped-query attention: share each k/v head among `rep` query heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


ACTIVATIONS = ("swiglu", "squared_relu")


class FeedForward(nn.Module):
    def __init__(self, dim, ffn_dim, activation="swiglu"):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False) if activation == "swiglu" else None
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x):
        if self.w3 is None:  # squared ReLU (Megatron's megatron.core.activations.squared_relu)
            return self.w2(torch.pow(F.relu(self.w1(x)), 2))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, ffn_dim, activation="swiglu"):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, ffn_dim, activation)

    def forward(self, x, rope):
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, n_layers, dim, n_heads, n_kv_heads, ffn_dim, seq_len, vocab_size, activation="swiglu"):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.register_buffer("rope", rope_tables(dim // n_heads, seq_len), persistent=False)
        self.layers = nn.ModuleList([TransformerBlock(dim, n_heads, n_kv_heads, ffn_dim, activation) for _ in range(n_layers)])
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h))


def _activation(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    return activation


def build_model(preset="llama-7b", n_layers=None, dim=None, n_heads=None, n_kv_heads=None, ffn_dim=None, seq_len=None, vocab_size=None, activation="swiglu"):
    cfg = _config(preset, n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_dim=ffn_dim, seq_len=seq_len, vocab_size=vocab_size)
    return Llama(**cfg, activation=_activation(activation))


def example_inputs(batch_size, preset="llama-7b", seq_len=None, vocab_size=None):
    cfg = _config(preset, seq_len=seq_len, vocab_size=vocab_size)
    return (torch.randint(0, cfg["vocab_size"], (batch_size, cfg["seq_len"])),)


def example_target(batch_size, preset="llama-7b", seq_len=None, vocab_size=None):
    cfg = _config(preset, seq_len=seq_len, vocab_size=vocab_size)
    return torch.randint(0, cfg["vocab_size"], (batch_size, cfg["seq_len"]))


def loss_fn(output, target):
    return F.cross_entropy(output.flatten(0, 1).float(), target.flatten(0, 1))


def architecture(preset="llama-7b", n_layers=None, dim=None, n_heads=None, n_kv_heads=None, ffn_dim=None, seq_len=None, vocab_size=None, activation="swiglu"):
    cfg = _config(preset, n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_dim=ffn_dim, seq_len=seq_len, vocab_size=vocab_size)
    return {
        "num_layers": cfg["n_layers"],
        "hidden_size": cfg["dim"],
        "num_attention_heads": cfg["n_heads"],
        "num_query_groups": cfg["n_kv_heads"],
        "ffn_hidden_size": cfg["ffn_dim"],
        "seq_length": cfg["seq_len"],
        "max_position_embeddings": cfg["seq_len"],
        "vocab_size": cfg["vocab_size"],
        "normalization": "RMSNorm",
        "activation": _activation(activation),
        "position_embedding": "rope",
        "tied_embeddings": False,
        "bias": False,
        "dropout": 0.0,
        "block_path": "layers",
    }
