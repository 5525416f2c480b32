"""A root-level shape branch (fx fails) and a constructor argument left at None passed to torch.topk (export and a
plain run fail the same way)."""

import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, k=None):
        super().__init__()
        self.k = k
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x):
        if x.shape[0] > 1:
            x = x * 2
        for layer in self.layers:
            x = layer(x)
        return torch.topk(x, k=self.k, dim=-1).values


def build_model(k=None):
    return Net(k)


def example_inputs(batch_size, k=None):
    return (torch.randn(batch_size, 8),)
