"""A block that branches on a shape: fx cannot trace inside it, but it runs on meta tensors."""
import torch
import torch.nn as nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.shape[0] > 1:
            return self.lin(x)
        return x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Gate() for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def build_model():
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 8),)
