"""The constructor computes layer widths with tensors and reads them back (as torchvision's RegNet does with
``torch.round(...).int().tolist()``): the meta device cannot read data, so the planner builds it with only its
parameters and buffers on meta. Widths: round(8 * 1.5 ** i) for i = 0, 1, 2 -> 8, 12, 18."""

import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        widths = torch.round(8 * torch.pow(torch.tensor(1.5), torch.arange(3))).int().tolist()
        dims = [8, *widths]
        self.layers = nn.ModuleList([nn.Linear(a, b) for a, b in zip(dims, dims[1:])])
        self.register_buffer("scale", torch.full((widths[-1],), 0.5))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x * self.scale


def build_model():
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 8),)
