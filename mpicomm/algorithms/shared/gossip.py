"""Gossip averaging: a rank's model replaced by the weighted sum of its own and its in-neighbours' rows."""

from __future__ import annotations

import torch

__all__ = ["gossip_average"]


def gossip_average(x: torch.Tensor, received: torch.Tensor, self_weight: float, weights,
                   gamma: float = 1.0) -> torch.Tensor:
    """``x <- self_weight * x + sum_k weights[k] * received[k]`` in place; returns ``x``.

    ``gamma`` < 1 damps the row toward the identity, ``(1 - gamma) I + gamma W``: ``x <- x + gamma sum_j W_ij
    (x_j - x)``; at gamma = 1 the row itself."""
    if gamma != 1.0:
        self_weight = 1.0 - gamma * (1.0 - self_weight)
        weights = [gamma * w for w in weights]
    x.mul_(self_weight)
    for w, row in zip(weights, received):
        x.add_(row, alpha=w)
    return x
