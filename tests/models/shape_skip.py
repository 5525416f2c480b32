"""A segmentation-style model: the input's spatial size is read first and used by the last piece to resize.

``batch_view=True`` reads the batch size instead (it changes with the micro-batch, so it cannot be fixed).
"""

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self, batch_view=False):
        super().__init__()
        self.batch_view = batch_view
        self.blocks = nn.ModuleList([nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()) for _ in range(3)])
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        size = x.shape[-2:]
        b = x.shape[0]
        x = self.stem(x)
        for blk in self.blocks:
            x = blk(x)
        x = self.head(x)
        if self.batch_view:
            x = x.reshape(b, 2, -1).reshape(x.shape)
        return F.interpolate(x, size=size, mode="bilinear", align_corners=False)


def build_model(batch_view=False):
    return Net(batch_view)


def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, 16, 16),)
