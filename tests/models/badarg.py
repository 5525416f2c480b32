"""forward() passes a constructor argument left at None to Tensor.view: fx records the call, running it fails."""

import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, k=None):
        super().__init__()
        self.k = k
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.view(self.k)


def build_model(k=None):
    return Net(k)


def example_inputs(batch_size, k=None):
    return (torch.randn(batch_size, 8),)
