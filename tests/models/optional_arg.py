"""Blocks and a model with optional forward arguments (attn_mask=None, scale=1.0) the example inputs do not give."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(s): super().__init__(); s.a=nn.Linear(16,16); s.b=nn.Linear(16,16)
    def forward(s, x, attn_mask=None):
        if attn_mask is not None: x = x + attn_mask
        return x + s.b(torch.relu(s.a(x)))
class Net(nn.Module):
    def __init__(s): super().__init__(); s.blocks=nn.ModuleList([Block() for _ in range(3)])
    def forward(s, x, attn_mask=None, scale=1.0):
        for b in s.blocks: x = b(x, attn_mask)
        return x * scale
def build_model(): return Net()
def example_inputs(batch_size): return (torch.randn(batch_size, 8, 16),)
