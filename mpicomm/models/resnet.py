"""CIFAR ResNets: the 3-stage 16-32-64 family (ResNet-20/32/44/56/110) and the CIFAR variant of ResNet-18.

He, Zhang, Ren, Sun, "Deep Residual Learning for Image Recognition", CVPR 2016 (section 4.2: 6n+2
layers, option A identity shortcuts with zero-padded channels). ResNet-18 is the 4-stage 64-512
BasicBlock network with a 3x3 stem and no max-pool, as used for CIFAR-10 in the APMSqueeze and
PD-SGDM experiments.

BatchNorm running statistics are buffers, not parameters: algorithms average parameters only, so each
rank keeps (and checkpoints) its own running statistics, and the averaged model is evaluated with the
evaluating rank's statistics. ``norm="group"`` swaps in GroupNorm (no running statistics at all).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["MODELS", "build_model", "check_model"]


def _norm(kind: str, channels: int) -> nn.Module:
    return nn.BatchNorm2d(channels) if kind == "batch" else nn.GroupNorm(min(8, channels), channels)


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions and a shortcut. Option A (``projection=False``, the CIFAR ResNets'): a stride-2
    subsample and zero channel padding, no parameters. Option B (ResNet-18's): a 1x1 convolution and a norm
    where the shape changes, the identity elsewhere."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str, projection: bool):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = _norm(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = _norm(norm, cout)
        self.shortcut = nn.Sequential()
        if projection and (stride != 1 or cin != cout):
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), _norm(norm, cout))
        self.pad = 0 if projection else cout - cin  # option A's zero channels
        self.stride = 1 if projection else stride  # option A's subsampling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual block forward."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = self.shortcut(x)
        if self.stride > 1:
            shortcut = shortcut[:, :, ::self.stride, ::self.stride]
        if self.pad:
            shortcut = F.pad(shortcut, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        return F.relu(out + shortcut)


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for 32x32 (or MNIST's 28x28) inputs: 16-32-64 channels, n blocks per stage."""

    def __init__(self, depth: int, num_classes: int = 10, norm: str = "batch", in_channels: int = 3):
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"CIFAR ResNet depth must be 6n+2 (8, 20, 32, 44, 56, 110), got {depth}")
        n = (depth - 2) // 6
        self.conv = nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False)
        self.bn = _norm(norm, 16)
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(n):
                layers.append(_BasicBlock(cin, cout, stride if i == 0 else 1, norm, projection=False))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of images (N, in_channels, H, W)."""
        out = self.layers(F.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


class ResNet18(nn.Module):
    """ResNet-18, CIFAR variant (3x3 stem, no max-pool), 64-128-256-512 channels."""

    def __init__(self, num_classes: int = 10, norm: str = "batch", in_channels: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
        self.bn = _norm(norm, 64)
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [_BasicBlock(cin, cout, stride, norm, projection=True),
                       _BasicBlock(cout, cout, 1, norm, projection=True)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of 3x32x32 images."""
        out = self.layers(F.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


MODELS = {f"resnet{d}": d for d in (8, 20, 32, 44, 56, 110)} | {"resnet18": 18}


def check_model(name: str, norm: str = "batch") -> None:
    """Raise ``ValueError`` naming the option unless ``name`` is in :data:`MODELS` and ``norm`` is batch or group."""
    if name not in MODELS:
        raise ValueError(f"--model: unknown model {name!r}; choose one of {sorted(MODELS)}")
    if norm not in ("batch", "group"):
        raise ValueError(f"--norm must be 'batch' or 'group', got {norm!r}")


def build_model(name: str, num_classes: int = 10, norm: str = "batch", seed: int = 0,
                in_channels: int = 3) -> nn.Module:
    """Build model ``name`` (see :data:`MODELS`) for ``in_channels``-channel images, weights drawn from ``seed``."""
    check_model(name, norm)
    torch.manual_seed(seed)
    if name == "resnet18":
        return ResNet18(num_classes, norm, in_channels)
    return CifarResNet(MODELS[name], num_classes, norm, in_channels)
