"""A parameter drawn with torch.normal(mean, std, size=...), as transformers' DiffLlama draws its lambda vectors: that
factory ignores the meta device context and allocates on the CPU."""

import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.gain = nn.Parameter(torch.normal(0, 0.1, size=(8,)))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x * self.gain


def build_model():
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 8),)
