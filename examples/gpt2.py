"""GPT-2 style decoder (learned positions, pre-LayerNorm, GELU MLP, tied output head).

A model file for `planner`: it defines build_model, example_inputs, loss_fn,
example_target and architecture. Pick a size with ``--model-arg preset=NAME``
(see PRESETS) and override any field, e.g. ``--model-arg seq_len=2048``.
``attention=explicit`` computes softmax(QK^T)V with explicit tensors (the
layer Korthikanti et al. 2022 analyse); the default ``sdpa`` calls
F.scaled_dot_product_attention (a flash kernel on GPUs).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {
    # name: layers, hidden, heads, seq, vocab
    "gpt2-tiny": dict(n_layer=4, n_embd=64, n_head=4, seq_len=32, vocab_size=256),
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12, seq_len=1024, vocab_size=50257),
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16, seq_len=1024, vocab_size=50257),
    "gpt2-large": dict(n_layer=36, n_embd=1280, n_head=20, seq_len=1024, vocab_size=50257),
    "gpt2-xl": dict(n_layer=48, n_embd=1600, n_head=25, seq_len=1024, vocab_size=50257),
    # Megatron-LM's published runs (Narayanan et al. 2021; Korthikanti et al. 2022), vocabulary padded to 51200.
    "megatron-22b": dict(n_layer=48, n_embd=6144, n_head=64, seq_len=2048, vocab_size=51200),
    "gpt3-175b": dict(n_layer=96, n_embd=12288, n_head=96, seq_len=2048, vocab_size=51200),
    "mt-nlg-530b": dict(n_layer=105, n_embd=20480, n_head=128, seq_len=2048, vocab_size=51200),
    "gpt-1t": dict(n_layer=128, n_embd=25600, n_head=160, seq_len=2048, vocab_size=51200),
    # BLOOM-like shape: a 250k vocabulary makes the embedding and head the heaviest pieces.
    "bloom-7b": dict(n_layer=30, n_embd=4096, n_head=32, seq_len=2048, vocab_size=250880),
}


def _config(preset="gpt2", n_layer=None, n_embd=None, n_head=None, seq_len=None, vocab_size=None):
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    cfg = dict(PRESETS[preset])
    for key, value in dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, seq_len=seq_len, vocab_size=vocab_size).items():
        if value is not None:
            cfg[key] = int(value)
    return cfg


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, dropout, attention):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.dropout = dropout
        self.attention = attention

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(h, dim=2)
        q = q.view(b, s, self.n_head, h // self.n_head).transpose(1, 2)
        k = k.view(b, s, self.n_head, h // self.n_head).transpose(1, 2)
        v = v.view(b, s, self.n_head, h // self.n_head).transpose(1, 2)
        if self.attention == "explicit":
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf"))
            att = self.attn_dropout(F.softmax(att, dim=-1))
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, s, h)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd, dropout):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, dropout, attention):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, attention)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, n_layer, n_embd, n_head, seq_len, vocab_size, dropout=0.1, attention="sdpa"):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(n_embd, n_head, dropout, attention) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied input and output embeddings
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(preset="gpt2", n_layer=None, n_embd=None, n_head=None, seq_len=None, vocab_size=None, dropout=0.1, attention="sdpa"):
    if attention not in ("sdpa", "explicit"):
        raise ValueError("attention must be 'sdpa' or 'explicit'")
    cfg = _config(preset, n_layer, n_embd, n_head, seq_len, vocab_size)
    return GPT(dropout=float(dropout), attention=attention, **cfg)


def example_inputs(batch_size, preset="gpt2", seq_len=None, vocab_size=None):
    cfg = _config(preset, seq_len=seq_len, vocab_size=vocab_size)
    return (torch.randint(0, cfg["vocab_size"], (batch_size, cfg["seq_len"])),)


def example_target(batch_size, preset="gpt2", seq_len=None, vocab_size=None):
    cfg = _config(preset, seq_len=seq_len, vocab_size=vocab_size)
    return torch.randint(0, cfg["vocab_size"], (batch_size, cfg["seq_len"]))


def loss_fn(output, target):
    return F.cross_entropy(output.flatten(0, 1).float(), target.flatten(0, 1))


def architecture(preset="gpt2", n_layer=None, n_embd=None, n_head=None, seq_len=None, vocab_size=None, dropout=0.1, attention="sdpa"):
    cfg = _config(preset, n_layer, n_embd, n_head, seq_len, vocab_size)
    return {
        "num_layers": cfg["n_layer"],
        "hidden_size": cfg["n_embd"],
        "num_attention_heads": cfg["n_head"],
        "num_query_groups": cfg["n_head"],
        "ffn_hidden_size": 4 * cfg["n_embd"],
        "seq_length": cfg["seq_len"],
        "max_position_embeddings": cfg["seq_len"],
        "vocab_size": cfg["vocab_size"],
        "normalization": "LayerNorm",
        "activation": "gelu",
        "position_embedding": "learned_absolute",
        "tied_embeddings": True,
        "bias": True,
        "dropout": float(dropout),
        "block_path": "h",
    }
