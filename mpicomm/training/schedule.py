"""Learning-rate schedules: linear warm-up, then constant, step decay or cosine decay.

``lr(t)`` for step t (0-based) of ``total`` steps::

    t <  warmup:  base * (t + 1) / warmup
    constant:     base
    step:         base * gamma ** (number of milestones <= t / total)   (milestones are fractions of the run)
    cosine:       base * (1 + cos(pi * (t - warmup) / (total - warmup))) / 2
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LRSchedule"]


@dataclass(frozen=True)
class LRSchedule:
    """A pure function of the step: nothing to checkpoint beyond the step counter."""

    base: float
    total: int
    kind: str = "cosine"
    warmup: int = 0
    milestones: tuple[float, ...] = (0.5, 0.75)
    gamma: float = 0.1

    def __post_init__(self):
        if self.kind not in ("constant", "step", "cosine"):
            raise ValueError(f"--lr-schedule must be constant, step or cosine, got {self.kind!r}")
        if self.total < 1:
            raise ValueError(f"the run must have at least one step, got {self.total}")
        if not 0 <= self.warmup < self.total:
            raise ValueError(f"--lr-warmup-steps must be in [0, {self.total}) (the run length), got {self.warmup}")
        if any(not 0 < m < 1 for m in self.milestones):
            raise ValueError(f"--milestones are fractions of the run in (0, 1), got {self.milestones}")

    def __call__(self, step: int) -> float:
        """The learning rate at 0-based ``step``."""
        if step < self.warmup:
            return self.base * (step + 1) / self.warmup
        if self.kind == "constant":
            return self.base
        if self.kind == "step":
            passed = sum(1 for m in self.milestones if step >= m * self.total)
            return self.base * self.gamma ** passed
        span = max(self.total - self.warmup, 1)
        return self.base * (1 + math.cos(math.pi * min(step - self.warmup, span) / span)) / 2
