"""Blocks that pass a (hidden, aux) tuple to the next block, as many library blocks do."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, state):
        h, aux = state
        h = torch.tanh(self.fc(h)) + aux
        return h, aux * 0.5


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])

    def forward(self, x):
        state = (x, x)
        for b in self.blocks:
            state = b(state)
        return state[0]


def build_model():
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 8, 32),)
