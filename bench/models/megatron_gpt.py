"""Megatron-LM's default GPT layer as its functional tests run it (bench model file, not an example).

What ``pretrain_gpt.py`` builds when only the shape is given (megatron/training/arguments.py defaults): learned
absolute positions, pre-LayerNorm, GELU MLP of 4 x hidden, biases on every linear, dropout 0.1, untied input and
output embeddings (``--untie-embeddings-and-output-weights``), and grouped-query attention (``--group-query-attention
--num-query-groups``). The vocabulary is passed padded as Megatron pads it (a multiple of 128 x tp,
``--make-vocab-size-divisible-by``). Used by bench/memory_runs.py for Megatron-LM's measured memory test cases.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, hidden, heads, groups, dropout):
        super().__init__()
        self.heads, self.groups, self.head_dim = heads, groups, hidden // heads
        self.qkv = nn.Linear(hidden, hidden + 2 * groups * self.head_dim)
        self.proj = nn.Linear(hidden, hidden)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        b, s, h = x.shape
        kv = self.groups * self.head_dim
        q, k, v = self.qkv(x).split([h, kv, kv], dim=2)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.groups, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.groups, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True, enable_gqa=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, s, h)))


class MLP(nn.Module):
    def __init__(self, hidden, dropout):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, hidden, heads, groups, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, groups, dropout)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, layers, hidden, heads, groups, seq_len, vocab_size, dropout):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(hidden, heads, groups, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(layers=32, hidden=4096, heads=32, groups=8, seq_len=8192, vocab_size=131200, dropout=0.1):
    return GPT(int(layers), int(hidden), int(heads), int(groups), int(seq_len), int(vocab_size), float(dropout))


def example_inputs(batch_size, seq_len=8192, vocab_size=131200, **_):
    return (torch.randint(0, int(vocab_size), (batch_size, int(seq_len))),)


def example_target(batch_size, seq_len=8192, vocab_size=131200, **_):
    return torch.randint(0, int(vocab_size), (batch_size, int(seq_len)))


def loss_fn(output, target):
    return F.cross_entropy(output.flatten(0, 1).float(), target.flatten(0, 1))


def architecture(layers=32, hidden=4096, heads=32, groups=8, seq_len=8192, vocab_size=131200, dropout=0.1):
    return {
        "num_layers": int(layers),
        "hidden_size": int(hidden),
        "num_attention_heads": int(heads),
        "num_query_groups": int(groups),
        "ffn_hidden_size": 4 * int(hidden),
        "seq_length": int(seq_len),
        "max_position_embeddings": int(seq_len),
        "vocab_size": int(vocab_size),
        "normalization": "LayerNorm",
        "activation": "gelu",
        "position_embedding": "learned_absolute",
        "tied_embeddings": False,
        "bias": True,
        "dropout": float(dropout),
        "block_path": "h",
    }
