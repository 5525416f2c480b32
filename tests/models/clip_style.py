"""A contrastive image-text model written the way open_clip writes CLIP: an image tower and a text tower, each
ending in a projection to one embedding width, a learned ``logit_scale`` (initialised at log(1/0.07)), and the
symmetric cross-entropy over the batch's similarity matrix with ``arange(batch)`` as targets (open_clip's
``ClipLoss``; transformers' ``CLIPModel(return_loss=True)`` computes the same). The loss is batch-coupled: each
sample's loss is over every other sample of its batch, so it is not the mean of per-sample losses."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Tower(nn.Module):
    def __init__(self, width, depth, out):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.proj = nn.Linear(width, out, bias=False)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.proj(x)


class CLIP(nn.Module):
    def __init__(self, patch=48, vocab=64, width=32, depth=2, embed=16):
        super().__init__()
        self.patch_embed = nn.Linear(patch, width)
        self.token_embed = nn.Embedding(vocab, width)
        self.visual = Tower(width, depth, embed)
        self.text = Tower(width, depth, embed)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, image, text):
        img = F.normalize(self.visual(self.patch_embed(image).mean(1)), dim=-1)
        txt = F.normalize(self.text(self.token_embed(text).mean(1)), dim=-1)
        return img, txt, self.logit_scale.exp()


def build_model():
    return CLIP()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 4, 48), torch.randint(0, 64, (batch_size, 8)))


def loss_fn(output, target):
    """open_clip's ClipLoss: cross-entropy both ways over the batch's similarity matrix, targets arange(batch)."""
    img, txt, scale = output
    logits = scale * img @ txt.t()
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
