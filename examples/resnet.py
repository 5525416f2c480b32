"""ResNet (He et al. 2016) with an optional feature-pyramid segmentation head.

A model file for `planner`, to show that planning is not only for
transformers. ``--model-arg preset=resnet50`` picks the depth;
``--model-arg head=fpn`` replaces the classifier by a feature-pyramid head
that reads the outputs of all four stages: those long skip connections cross
every pipeline cut between the stage that makes them and the head.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {
    # name: block type, blocks per stage, base width, image size, classes
    "resnet-tiny": dict(block="basic", layers=(1, 1, 1, 1), width=8, image_size=64, num_classes=10),
    "resnet18": dict(block="basic", layers=(2, 2, 2, 2), width=64, image_size=224, num_classes=1000),
    "resnet34": dict(block="basic", layers=(3, 4, 6, 3), width=64, image_size=224, num_classes=1000),
    "resnet50": dict(block="bottleneck", layers=(3, 4, 6, 3), width=64, image_size=224, num_classes=1000),
    "resnet101": dict(block="bottleneck", layers=(3, 4, 23, 3), width=64, image_size=224, num_classes=1000),
    "resnet152": dict(block="bottleneck", layers=(3, 8, 36, 3), width=64, image_size=224, num_classes=1000),
}


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, block, layers, width, image_size, num_classes, head="classify"):
        super().__init__()
        block_cls = {"basic": BasicBlock, "bottleneck": Bottleneck}[block]
        self.head_kind = head
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin, stages = width, []
        for i, n in enumerate(layers):
            w = width * 2**i
            blocks = []
            for j in range(n):
                blocks.append(block_cls(cin, w, 2 if (j == 0 and i > 0) else 1))
                cin = w * block_cls.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        if head == "classify":
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(cin, num_classes)
        else:  # feature pyramid: lateral 1x1 convs on every stage's output, top-down sum, per-pixel classifier
            channels = [width * 2**i * block_cls.expansion for i in range(4)]
            fpn = 4 * width
            self.lateral = nn.ModuleList([nn.Conv2d(c, fpn, 1) for c in channels])
            self.classifier = nn.Conv2d(fpn, num_classes, 3, padding=1)

    def forward(self, images):
        x = self.maxpool(F.relu(self.bn1(self.conv1(images))))
        c2 = self.layer1(x)
        c3 = self.layer2(c2)
        c4 = self.layer3(c3)
        c5 = self.layer4(c4)
        if self.head_kind == "classify":
            return self.fc(torch.flatten(self.avgpool(c5), 1))
        p = self.lateral[3](c5)
        p = self.lateral[2](c4) + F.interpolate(p, scale_factor=2.0, mode="nearest")
        p = self.lateral[1](c3) + F.interpolate(p, scale_factor=2.0, mode="nearest")
        p = self.lateral[0](c2) + F.interpolate(p, scale_factor=2.0, mode="nearest")
        return self.classifier(p)


def _config(preset, image_size=None, num_classes=None):
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    cfg = dict(PRESETS[preset])
    if image_size is not None:
        cfg["image_size"] = int(image_size)
    if num_classes is not None:
        cfg["num_classes"] = int(num_classes)
    return cfg


def build_model(preset="resnet50", head="classify", image_size=None, num_classes=None):
    if head not in ("classify", "fpn"):
        raise ValueError("head must be 'classify' or 'fpn'")
    return ResNet(head=head, **_config(preset, image_size, num_classes))


def example_inputs(batch_size, preset="resnet50", image_size=None):
    size = _config(preset, image_size)["image_size"]
    return (torch.randn(batch_size, 3, size, size),)


def example_target(batch_size, preset="resnet50", head="classify", image_size=None, num_classes=None):
    cfg = _config(preset, image_size, num_classes)
    if head == "classify":
        return torch.randint(0, cfg["num_classes"], (batch_size,))
    return torch.randint(0, cfg["num_classes"], (batch_size, cfg["image_size"] // 4, cfg["image_size"] // 4))


def loss_fn(output, target):
    return F.cross_entropy(output.float(), target)
