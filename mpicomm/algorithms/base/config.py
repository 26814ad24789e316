"""The options every algorithm has (:class:`AlgorithmConfig`) and the checks that refuse a bad option value
in one line naming it (:func:`check_range`, :func:`check_int`, :func:`check_bool`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["AlgorithmConfig", "GossipOverlapConfig", "check_bool", "check_int", "check_range"]


def check_range(name: str, value, lo=None, hi=None, lo_open=False, hi_open=False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a finite number in the stated interval."""
    bad = (lo is not None and (value <= lo if lo_open else value < lo)) or \
          (hi is not None and (value >= hi if hi_open else value > hi))
    if bad or not math.isfinite(value):  # NaN fails every comparison; no option means anything at infinity
        left = "(-inf" if lo is None else ("(" if lo_open else "[") + str(lo)
        right = "inf)" if hi is None else str(hi) + (")" if hi_open else "]")
        raise ValueError(f"{name} must be in {left}, {right}, got {value!r}")


def check_int(name: str, value, lo: int) -> None:
    """ValueError naming ``name`` unless ``value`` is an int (not a bool) >= ``lo``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


def check_bool(name: str, value) -> None:
    """ValueError naming ``name`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


@dataclass(frozen=True)
class AlgorithmConfig:
    """Options every algorithm has. Subclasses add their own fields (all with defaults).

    lr: step size alpha. momentum: heavy-ball momentum of the local torch.optim step, where the
    algorithm takes one. weight_decay: L2 weight decay of that step. seed: for every random choice the
    algorithm makes (codec rounding, peer choice). broadcast_init: start every rank from rank 0's
    parameters (turn off only if they already agree).
    """

    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    broadcast_init: bool = True

    def __post_init__(self):
        check_range("lr", self.lr, lo=0.0, lo_open=True)
        check_range("momentum", self.momentum, lo=0.0, hi=1.0, hi_open=True)
        check_range("weight_decay", self.weight_decay, lo=0.0)


@dataclass(frozen=True)
class GossipOverlapConfig(AlgorithmConfig):
    """overlap: start the exchange of the current iterate in begin_step(), before the forward pass, and finish
    it in step(), so the transfer runs while the gradient is computed (bit for bit the blocking step; a loop
    that does not call begin_step() gets the blocking exchange)."""

    overlap: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_bool("overlap", self.overlap)
