"""Moniqua's options, shared by Moniqua, Moniqua-D² and Moniqua-AD-PSGD."""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import ClassVar, Union

from ...codecs.moniqua import ROUNDINGS
from ..base import AlgorithmConfig, check_bool, check_range
from ..shared.hierarchy import NodeGraphConfig
from .theta import THETA_RULES

__all__ = ["GUARDS", "IDENTITY_BITS", "MODULO_BITS", "MoniquaConfig", "MoniquaDPSGDConfig", "default_gamma"]

MODULO_BITS = (1, 2, 4, 8)
GUARDS = ("skip", "resync", "raise")
IDENTITY_BITS = 32
"""``bits`` value meaning "no codec": the fp32 model is sent and x̂_j = x_j exactly."""


def default_gamma(bits: int) -> float:
    """gamma when none is given: 0.5 at 1-2 bits (gamma < 1 is needed there, see the docs), else 1.0."""
    return 0.5 if bits <= 2 else 1.0


@dataclass(frozen=True)
class MoniquaConfig(AlgorithmConfig):
    """Moniqua options.

    bits: 1, 2, 4 or 8 (modulo codec) or 32 (identity). parts: P, each tensor sends one of P rotating
    parts per step (1: every coordinate). rounding: "dither" (shared subtractive), "nearest" or
    "stochastic" (bits >= 2). gamma: consensus step in (0, 1]; None: 0.5 at 1-2 bits, else 1.
    theta: a number > 0 (fixed), "observed" (default: from the recovered distances) or "adaptive" (the
    worst-case bound rule), see :mod:`.theta`. "observed" is the default because the bound rule's factor
    t_mix grows with the ring, widening theta's grid; on full MNIST (ResNet-8, 1,500 steps, 2 seeds) the
    observed rule ends within 0.3 points of D-PSGD at 8 ranks (ring and exponential) and at 16 ranks on the
    ring, with no wrap (``docs/results/scale.md``).
    theta_per: "tensor" or "model" (one theta, the paper's).
    theta_c: C of the adaptive rule. theta_decay: per-step decay of its running step bound, in [0, 1].
    theta_shrink: the guard scale's factor on a clean step, in (0, 1]. theta_cap: the most the guard
    may enlarge theta, >= 1. guard: "skip", "resync" or "raise".
    """

    bits: int = 4
    parts: int = 4
    rounding: str = "dither"
    gamma: Union[float, None] = None
    theta: Union[float, str] = "observed"
    theta_per: str = "tensor"
    theta_c: float = 1.0
    theta_decay: float = 0.99
    theta_shrink: float = 0.9
    theta_cap: float = 16.0
    guard: str = "skip"

    gamma_from_graph: ClassVar[bool] = False
    """True where the algorithm settles gamma=None against the run's graph (Moniqua-D²), not from ``bits`` here."""

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.bits, bool) or self.bits not in (*MODULO_BITS, IDENTITY_BITS):
            raise ValueError(f"bits must be one of 1, 2, 4, 8 (modulo codec) or 32 (identity), got {self.bits!r}")
        if isinstance(self.parts, bool) or not isinstance(self.parts, int) or self.parts < 1:
            raise ValueError(f"parts must be an int >= 1, got {self.parts!r}")
        if self.bits == IDENTITY_BITS and self.parts != 1:
            raise ValueError(f"parts must be 1 with bits=32 (the identity sends the whole model), got {self.parts}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if self.rounding == "stochastic" and self.bits == 1:
            raise ValueError("rounding='stochastic' needs bits >= 2 (at 1 bit B_theta is infinite); "
                             "rounding='dither' gives a zero-mean error without a dead zone at 1 bit")
        if self.gamma is None and not self.gamma_from_graph:
            object.__setattr__(self, "gamma", default_gamma(self.bits))
        if self.gamma is not None:
            check_range("gamma", self.gamma, lo=0.0, hi=1.0, lo_open=True)
        if self.theta not in THETA_RULES and (isinstance(self.theta, bool) or not isinstance(self.theta, Real)
                                              or not (math.isfinite(self.theta) and self.theta > 0)):
            raise ValueError(f"theta must be 'adaptive', 'observed' or a finite number > 0, got {self.theta!r}")
        if self.theta_per not in ("tensor", "model"):
            raise ValueError(f"theta_per must be 'tensor' or 'model', got {self.theta_per!r}")
        check_range("theta_c", self.theta_c, lo=0.0, lo_open=True)
        check_range("theta_decay", self.theta_decay, lo=0.0, hi=1.0)
        check_range("theta_shrink", self.theta_shrink, lo=0.0, hi=1.0, lo_open=True)
        check_range("theta_cap", self.theta_cap, lo=1.0)
        if self.guard not in GUARDS:
            raise ValueError(f"guard must be one of {GUARDS}, got {self.guard!r}")


@dataclass(frozen=True)
class MoniquaDPSGDConfig(NodeGraphConfig, MoniquaConfig):
    """Moniqua (on D-PSGD) options: those above, overlap, hierarchical and node_topology.

    overlap: encode and send the model in begin_step(), before the forward pass, finish the mix in step()
    and settle its agreement (wrapped parts, theta's inputs) one step later, so nothing in step() waits for
    the network; theta is then one step older (with a fixed theta and no wrap, bit for bit the blocking
    step). The first step under an adaptive or observed theta exchanges blocking. hierarchical: the node's
    exact average, then Moniqua's round between nodes on each local rank's shard (not with overlap).
    """

    # Moniqua-D² and Moniqua-AD-PSGD have no such option: D² sends x_{k+1/2}, which needs the gradient, and
    # AD-PSGD's pulls are asynchronous already.
    overlap: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_bool("overlap", self.overlap)
