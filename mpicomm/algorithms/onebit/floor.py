"""The floor under the 1-bit family's Adam denominator, for coordinates the variance barely saw.

APMSqueeze, 0/1 Adam and 1-bit LAMB divide a 1-bit-averaged momentum by sqrt(v) + eps with v frozen (or, in
0/1 Adam's first phase, updated only on variance steps). A coordinate whose gradient stayed (near) zero while
v was measured -- an embedding row no batch used yet, a position beyond the sequence length, a bias that a
normalisation makes irrelevant -- keeps v ~ 0. The 1-bit average cannot send an exact zero: every coordinate
of a chunk comes back as +-(the chunk's scale), so such a coordinate moves by lr * scale / eps per step
(1e5 to 1e8 times lr), where Adam with a live v would have moved it by about lr.

The floor: before eps is added, every denominator is raised to at least
``denominator_floor * mean_j sqrt(v_j)``, the mean over all of the model's coordinates (identical on every
rank, as v is). The 1-bit momentum's magnitude is about that mean, so a floored coordinate moves by at most
about ``lr / denominator_floor`` per step instead of ``lr * scale / eps``. Coordinates whose denominator is
above the floor are untouched: their steps are the published method's. ``denominator_floor=0`` is the
published method (and DeepSpeed's code, whose answer is a hand-made mask: ``exp_avg_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import AlgorithmConfig, check_range

__all__ = ["DEFAULT_FLOOR", "DenominatorFloorConfig", "raise_to_floor"]

DEFAULT_FLOOR = 0.01


@dataclass(frozen=True)
class DenominatorFloorConfig(AlgorithmConfig):
    """denominator_floor: the smallest Adam denominator sqrt(v) (before eps), as a fraction in [0, 1] of its mean
    over the model; a coordinate the variance barely saw then moves by about lr / denominator_floor per step,
    not lr * scale / eps (0: no floor, the published method)."""

    # listed last among a config's bases, so that its inherited fields set no other field's default
    denominator_floor: float = DEFAULT_FLOOR

    def __post_init__(self):
        super().__post_init__()
        check_range("denominator_floor", self.denominator_floor, lo=0.0, hi=1.0)


def raise_to_floor(denom: torch.Tensor, fraction: float, mean: float | None = None) -> float:
    """``denom`` (sqrt(v), before eps) <- max(denom, fraction * mean(denom)) in place; returns that floor.

    Every rank holds the same v and runs the same reduction, so every rank gets the same floor (as LAMB's
    per-layer norms); nothing is allocated beyond a scalar. ``mean``: the mean over the whole model when
    ``denom`` is one rank's shard of it (agreed by the caller)."""
    if not fraction:
        return 0.0
    floor = fraction * (float(denom.mean()) if mean is None else mean)
    denom.clamp_(min=floor)
    return floor
