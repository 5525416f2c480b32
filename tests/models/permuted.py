"""Blocks whose output is a transposed (non-contiguous) view, as ConvNeXt's channels-last permutes are."""
import torch
import torch.nn as nn


class Flip(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(n, n)

    def forward(self, x):
        return torch.tanh(self.lin(x.transpose(1, 2))).transpose(1, 2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Flip(8) for _ in range(4)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def build_model():
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 8, 8),)
