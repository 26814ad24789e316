"""D² (decentralized training over decentralized data) and Moniqua-D² (its modulo-quantized gossip).

Tang, Lian, Yan, Zhang, Liu. "D²: Decentralized Training over Decentralized Data." ICML 2018.
Lu, De Sa. "Moniqua: Modulo Quantized Communication in Decentralized SGD." ICML 2020 (Moniqua-D²).

Step k on rank i (g_k the stochastic gradient at x_k plus weight_decay * x_k, alpha_k the step size
of step k, W the mixing matrix of ``comm.topology(k)``)::

    x_{1/2}     = x_0 - alpha_0 g_0                                                   (first step)
    x_{k+1/2}   = 2 x_k - x_{k-1} - alpha_k g_k + alpha_{k-1} g_{k-1}                 (later steps)
    d2:          x_{k+1} = sum_j W_ij x_{j,k+1/2}                       (D-PSGD's ``gossip_average``)
    moniqua_d2:  x_{k+1} = x_{k+1/2} + gamma sum_j W_ij (x̂_{j,k+1/2} - x̂_{i,k+1/2})  (Moniqua's recovery)

With a user optimizer (``optimizer=opt``) its update at x_k, ``d_k = opt.step(x_k, g_k) - x_k``, takes
the place of ``-alpha_k g_k`` (and d_{k-1} that of ``-alpha_{k-1} g_{k-1}``, kept instead of g_{k-1}), so
``x_{k+1/2} = 2 x_k - x_{k-1} + d_k - d_{k-1}``; Moniqua-D²'s statistic is then ``||d_k||_inf``. D²'s
analysis covers plain SGD steps; an optimizer with momentum or Adam's scaling runs outside it.

With a constant step size the middle line is the paper's ``2 x_k - x_{k-1} - alpha (g_k - g_{k-1})``;
keeping alpha_{k-1} makes learning-rate schedules exact. Extra memory: x_{k-1} and g_{k-1} (D² needs
both; Moniqua adds only payload-sized buffers, see :mod:`.moniqua`). D² has no momentum (a momentum
other than 0 is a configuration error). With ``bits=32`` and gamma = 1 Moniqua-D² runs the very same code as ``d2`` and
equals it bit for bit.

Guard (see :mod:`.moniqua`): Moniqua's mixing preserves the average exactly (every step's matrix is W on
the parts sent and I elsewhere, both doubly stochastic; every rank recovers the same lattice point), which
D² relies on: its recursion keeps x̄_{k+1} - x̄_k = -alpha ḡ_k. The guard checks before it mixes, so a
wrap never moves the average; the skipped part is mixed with I instead of W that step, and D²'s
extrapolation assumes the same mixing on consecutive steps, so Moniqua-D² restarts its recursion after a
wrap: the next step is a first step again (x_{k+1/2} = x_k - alpha g_k). Moniqua-D² shares Moniqua's
options and defaults (theta per tensor, dither, rotating parts); its theta statistic is alpha ||g_k||_inf
per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codecs._layout import chunk_elems, chunk_ranges
from .base import Algorithm, AlgorithmConfig, clone_optimizer_state
from .dpsgd import gossip_average
from .moniqua import ModuloGossip, MoniquaConfig
from .registry import register

__all__ = ["D2", "D2Config", "MoniquaD2", "MoniquaD2Config"]


def _no_momentum(config: AlgorithmConfig) -> None:
    if config.momentum != 0.0:
        raise ValueError(f"momentum must be 0 for D² (its update has no momentum term), got {config.momentum!r}")


@dataclass(frozen=True)
class D2Config(AlgorithmConfig):
    """D² options: those of every algorithm; momentum must stay 0."""

    def __post_init__(self):
        super().__post_init__()
        _no_momentum(self)


@dataclass(frozen=True)
class MoniquaD2Config(MoniquaConfig):
    """Moniqua-D² options: Moniqua's (bits, rounding, gamma, theta, ...); momentum must stay 0."""

    def __post_init__(self):
        super().__post_init__()
        _no_momentum(self)


@register
class D2(Algorithm):
    """D²: an extrapolated local step that cancels the data-heterogeneity drift, then full-precision gossip."""

    name = "d2"
    config_class = D2Config
    takes_optimizer = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        x = self.flat.data
        self.x_prev = torch.zeros_like(x)
        self.g_prev = torch.zeros_like(x)
        self.lr_prev = 0.0
        self.started = False
        self._chunk = chunk_elems(x.device)

    def _step(self, grad: torch.Tensor) -> None:
        self._decayed(grad)
        update = self._user_update()
        # the step is lr * direction: alpha_k g_k, or -d_k with a user optimizer (then lr = 1)
        direction, lr = (grad, self.lr) if update is None else (update.neg_(), 1.0)
        x = self.flat.data
        if self.started:  # x_prev <- x_{k+1/2}, then swap, so that x = x_{k+1/2} and x_prev = x_k
            self.x_prev.neg_().add_(x, alpha=2.0).sub_(direction, alpha=lr).add_(self.g_prev, alpha=self.lr_prev)
            self._swap(x, self.x_prev)
        else:
            self.x_prev.copy_(x)
            x.sub_(direction, alpha=lr)
            self.started = True
        self.g_prev.copy_(direction)
        self.lr_prev = lr
        self._mix(x, direction, lr)

    def _mix(self, x: torch.Tensor, direction: torch.Tensor, lr: float) -> None:
        """x_{k+1} = sum_j W_ij x_{j,k+1/2}, exactly as D-PSGD mixes."""
        topo = self.comm.topology(self.step_count)
        rows = self.comm.neighbor_allgather(x, step=self.step_count)
        gossip_average(x, rows, topo.self_weight(self.comm.rank), topo.neighbor_weights(self.comm.rank))

    def _swap(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Exchange the contents of ``a`` and ``b`` through one chunk-sized temporary."""
        tmp = torch.empty(min(self._chunk, a.numel()), dtype=a.dtype, device=a.device)
        for start, stop in chunk_ranges(a.numel(), self._chunk):
            t = tmp[:stop - start].copy_(a[start:stop])
            a[start:stop].copy_(b[start:stop])
            b[start:stop].copy_(t)

    def _extra_state(self):
        state = {"x_prev": self.x_prev.clone(), "g_prev": self.g_prev.clone(), "lr_prev": self.lr_prev,
                 "started": self.started}
        if self.user_optimizer:
            state["optimizer"] = clone_optimizer_state(self.optimizer)
        return state

    def _load_extra_state(self, extra):
        if self.user_optimizer:
            self.optimizer.load_state_dict(extra["optimizer"])
        self.x_prev.copy_(extra["x_prev"])
        self.g_prev.copy_(extra["g_prev"])
        self.lr_prev, self.started = float(extra["lr_prev"]), bool(extra["started"])


@register
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
