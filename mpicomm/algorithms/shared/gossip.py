"""Gossip averaging: a rank's model replaced by the weighted sum of its own and its in-neighbours' rows."""

from __future__ import annotations

import torch

__all__ = ["gossip_average"]


def gossip_average(x: torch.Tensor, received: torch.Tensor, self_weight: float, weights) -> torch.Tensor:
    """``x <- self_weight * x + sum_k weights[k] * received[k]`` in place; returns ``x``."""
    x.mul_(self_weight)
    for w, row in zip(weights, received):
        x.add_(row, alpha=w)
    return x
