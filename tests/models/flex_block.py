"""Flex attention called in eager mode inside each block, the block mask made there (the pattern of the PyTorch
FlexAttention blog's examples): no torch.compile anywhere."""

import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class Attn(nn.Module):
    def __init__(self, d=64, h=4):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.h = h

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        mask = create_block_mask(causal, None, None, T, T, device=x.device)
        y = flex_attention(q, k, v, block_mask=mask)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.layers = nn.ModuleList(Attn() for _ in range(2))
        self.head = nn.Linear(64, 100)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def build_model():
    return M()


def example_inputs(batch_size):
    return (torch.randint(0, 100, (batch_size, 128)),)
