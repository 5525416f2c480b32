"""A root-level branch on a shape: torch.fx cannot trace it, torch.export can (it specializes shapes)."""
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        if x.shape[0] > 0:
            x = x * 2
        for layer in self.layers:
            x = layer(x)
        return x


def build_model():
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 8),)
