"""Data-dependent control flow at the root module: no --leaf can hide it."""
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        x = self.a(x)
        if x.mean() > 0:
            x = self.b(x)
        return x


def build_model():
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 8),)
