"""torchvision's ResNet Bottleneck as written there: residual add, then an in-place ReLU; BatchNorm everywhere.

A 1x1 map at the end (BatchNorm needs two samples to train), and a depthwise stage (groups = channels).
"""

import torch
from torch import nn


class Bottleneck(nn.Module):
    def __init__(self, c, depthwise=False):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, groups=c if depthwise else 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.conv3 = nn.Conv2d(c, c, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        out = self.relu(out)
        return out


class Net(nn.Module):
    def __init__(self, c=16, n=3, depthwise=False, size=1):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.layers = nn.Sequential(*[Bottleneck(c, depthwise) for _ in range(n)])
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.head(x.mean((2, 3)))


def build_model(c=16, n=3, depthwise=False, size=1):
    return Net(c, n, depthwise)


def example_inputs(batch_size, size=1):
    return (torch.randn(batch_size, 3, size, size),)
