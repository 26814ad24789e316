"""The MNIST-1D paper's convolutional network (Greydanus & Kobak, ICML 2024; its ``ConvBase``): three 1-D
convolutions of 25 channels (kernel 5, then 3 and 3; stride 2, padding 1), each followed by a ReLU, and a
linear layer from the flattened features to the classes. 5,210 parameters on sequences of 40 values; about
94 % on MNIST-1D in the paper.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CONV1D_MODELS", "Conv1dNet", "build_conv1d"]

CONV1D_MODELS = ("conv1d",)
"""The model names this module builds (models for 1-D sequences, not images)."""


def _length_after(length: int, kernel: int) -> int:
    """A sequence's length after a convolution of ``kernel`` with stride 2 and padding 1."""
    return (length + 2 - kernel) // 2 + 1


class Conv1dNet(nn.Module):
    """Three ReLU convolutions over (N, 1, ``length``) sequences, then a linear layer to ``num_classes`` logits."""

    def __init__(self, num_classes: int = 10, length: int = 40, channels: int = 25):
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        features = _length_after(_length_after(_length_after(length, 5), 3), 3)
        self.linear = nn.Linear(channels * features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (N, num_classes) of sequences ``x`` (N, 1, length)."""
        h = self.conv1(x).relu()
        h = self.conv2(h).relu()
        h = self.conv3(h).relu()
        return self.linear(h.flatten(1))


def build_conv1d(num_classes: int = 10, length: int = 40, seed: int = 0) -> Conv1dNet:
    """:class:`Conv1dNet` for sequences of ``length`` values, its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return Conv1dNet(num_classes, length)
