"""Moniqua-D²: D²'s extrapolated local step, then Moniqua's modulo-quantized mixing of x_{k+1/2}.

Lu, De Sa. "Moniqua: Modulo Quantized Communication in Decentralized SGD." ICML 2020 (Moniqua-D²);
Tang, Lian, Yan, Zhang, Liu. "D²: Decentralized Training over Decentralized Data." ICML 2018.

Step k on rank i (g_k the gradient at x_k plus weight_decay x_k, alpha_k the step size of step k)::

    x_{k+1/2} = 2 x_k - x_{k-1} - alpha_k g_k + alpha_{k-1} g_{k-1}      (x_0 - alpha_0 g_0 at the first step)
    x_{k+1}   = x_{k+1/2} + gamma sum_j W_ij (x̂_{j,k+1/2} - x̂_{i,k+1/2})   (:class:`.gossip.ModuloGossip`)

The mixing preserves the average exactly, which D²'s recursion relies on. A part the guard skipped was
mixed with I instead of W, and D²'s extrapolation assumes the same mixing on consecutive steps, so the
recursion restarts after a wrap (the next step is a first step again). Options and defaults are
Moniqua's; theta's statistic is alpha ||g_k||_inf per tensor. ``bits=32, gamma=1`` is ``d2`` bit for bit.

No overlap with the forward and backward pass (no ``overlap`` option, unlike ``moniqua``): the codes are
of x_{k+1/2}, which holds -alpha_k g_k, so the message can only be encoded after the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..decentralized.d2 import D2, check_no_momentum
from .config import MoniquaConfig
from .gossip import ModuloGossip

__all__ = ["MoniquaD2", "MoniquaD2Config"]


@dataclass(frozen=True)
class MoniquaD2Config(MoniquaConfig):
    """Moniqua-D² options: Moniqua's (bits, rounding, gamma, theta, ...); momentum must stay 0."""

    def __post_init__(self):
        super().__post_init__()
        check_no_momentum(self)


class MoniquaD2(D2):
    """Moniqua-D²: D²'s extrapolated step, then Moniqua's modulo-quantized mixing of x_{k+1/2}."""

    name = "moniqua_d2"
    config_class = MoniquaD2Config

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        self.gossip = ModuloGossip(comm, self.config, self.flat)

    def _mix(self, x, direction, lr):
        if self.gossip.mix(x, self.step_count, self.gossip.step_sizes(direction, lr)):
            self.started = False  # a skipped part mixed with I this step, not W: restart D²'s recursion

    def stats(self):
        """Base stats plus theta's range, gamma and the guard's counters."""
        return {**super().stats(), **self.gossip.stats()}

    def metrics(self):
        """theta and wrapped parts per tensor group (see :meth:`ModuloGossip.metrics`)."""
        return self.gossip.metrics()

    def close(self):
        """Summarise the guard once (rank 0), then close."""
        self.gossip.close()
        super().close()

    def _extra_state(self):
        return {**super()._extra_state(), "gossip": self.gossip.state_dict()}

    def _load_extra_state(self, extra):
        super()._load_extra_state(extra)
        self.gossip.load_state_dict(extra["gossip"])
