"""Moniqua's theta per tensor: follows each tensor's own local step (so the learning rate), with a guard scale.

For tensor l at step k (all inputs agreed by the per-step allreduce(max), so theta is identical on
every rank)::

    M_l     <- max(decay M_l, max_i s_{i,l})      s_{i,l} = max(||alpha (mu buf_i + g_i)_l||_inf,
                                                            floor ||x_{i,l}||_inf / (2 C t))
    theta_l  = 2 C M_l t  scale_l                 t = P t_mix (a coordinate is mixed every P-th step)
    scale_l <- min(2 scale_l, cap) if part l wrapped on some edge, else max(shrink scale_l, 1)

Why 2 M t: two neighbours' local steps push them at most 2 M apart per step and the mixing removes a
fraction 1/t_mix of the disagreement per mixing round, which a coordinate gets every P-th step. M is a
running max that decays, so theta follows the learning-rate schedule down (the old whole-model rule only
ever shrank and fell to 0.64x while a cosine lr went to 0). The floor ``2^-12 ||x_l||_inf`` keeps the
grid above float32 resolution. ``per="model"`` is the paper's form: one M (the max over tensors) and one
scale, so every tensor gets the same theta.

``theta="observed"`` replaces the worst-case factor t_mix by the spread the receivers actually see::

    D_l     <- max(decay D_l, max over ranks i and in-neighbours j of ||x̂_j - x_i||_inf on l's part)
    theta_l  = 2 C (D_l + P M_l) scale_l          (the bound rule above until D is first seen)

The recovery condition is |x_i - x_j| < theta on every coordinate sent. A coordinate is sent every P-th
step, and in between two ranks' local steps move it apart by at most 2 P M; D is the distance measured
(before mixing) on the parts sent at the last steps, so with C = 1 theta is twice what was seen plus the
worst drift until the next send (the floor's ``2 C t`` becomes ``2 C P``, so theta >= 2^-12 ||x_l||_inf
here too). The measurement costs one max per tensor in the decode and T more float32
in the per-step allreduce(max) (3 T instead of 2 T). D is taken only from parts that did not wrap (a wrapped
recovery aliases to a small distance); a part that wraps anyway doubles its scale, as above. Why it exists:
the bound rule's P t_mix is 8 on a 4-ring but about 43 on an 8-ring, so there theta, and with it the
quantization error theta / 2^(b-1), is many times the distance it has to cover.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

__all__ = ["THETA_FLOOR", "THETA_RULES", "TensorTheta", "matrix_mixing_time", "mixing_time"]

THETA_FLOOR = 2.0**-12
"""Adaptive theta is at least this times ||x_l||_inf (8-bit grid >= 16 float32 ulps)."""

THETA_RULES = ("adaptive", "observed")
"""The words ``theta`` accepts besides a fixed number: the bound rule and the observed-distance rule."""


def mixing_time(schedule, gamma: float) -> float:
    """t_mix of the damped mixing ``(1 - gamma) I + gamma W_t`` over one period of ``schedule``."""
    n = schedule.size
    return matrix_mixing_time([(1.0 - gamma) * np.eye(n) + gamma * schedule.at(t).W for t in range(schedule.period)])


def matrix_mixing_time(matrices) -> float:
    """``max(1, ln n) / (1 - rho)``, rho = ||prod_t (M_t - 11^T/n)||_2^(1/period); 1 for n = 1."""
    n = matrices[0].shape[0]
    if n == 1:
        return 1.0
    J = np.full((n, n), 1.0 / n)
    prod = np.eye(n)
    for M in matrices:
        prod = (M - J) @ prod
    rho = float(np.linalg.norm(prod, 2)) ** (1.0 / len(matrices))
    return max(1.0, math.log(n)) / max(1.0 - rho, 1e-12)


class TensorTheta:
    """theta of each of ``count`` tensors: fixed, adaptive ``2 C M_l t`` or observed ``2 C (D_l + P M_l)``,
    times the guard's scale per tensor (``t = P t_mix``)."""

    def __init__(self, count: int, config, t: float):
        self.count, self.t, self.parts = count, t, config.parts
        self.fixed = None if config.theta in THETA_RULES else float(config.theta)
        self.observed = config.theta == "observed"
        self.floor_t = self.parts if self.observed else t  # theta >= THETA_FLOOR ||x_l|| either way
        self.per_model = config.theta_per == "model"
        self.c, self.decay = config.theta_c, config.theta_decay
        self.cap, self.shrink = config.theta_cap, config.theta_shrink
        self.bound: torch.Tensor | None = None  # M_l (float64)
        self.distance: torch.Tensor | None = None  # D_l (float64), observed rule only
        self.scale = torch.ones(count, dtype=torch.float64)

    def ready(self) -> bool:
        """Whether theta is known (adaptive needs one observation first)."""
        return self.fixed is not None or self.bound is not None

    def statistic(self, step_inf: torch.Tensor, x_inf: torch.Tensor) -> torch.Tensor:
        """This rank's s_l (to be agreed by max): the local step, at least the floor's share of ||x_l||."""
        return torch.maximum(step_inf.double(), x_inf.double() * (THETA_FLOOR / (2.0 * self.c * self.floor_t)))

    def observe(self, agreed: torch.Tensor) -> None:
        """Fold in one step's agreed max_i s_{i,l}."""
        self.bound = self._fold(self.bound, agreed.double().clamp_min(1e-30))

    def observe_distance(self, agreed: torch.Tensor, wrapped: torch.Tensor) -> None:
        """Fold in one step's agreed max distance per tensor, leaving out the tensors whose part ``wrapped`` (bool)."""
        self.distance = self._fold(self.distance, torch.where(wrapped, 0.0, agreed.double()))

    def _fold(self, running: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """``max(decay running, new)`` (``new`` alone at first); one value for all tensors under per="model"."""
        if self.per_model:
            new = new.max().expand(self.count).clone()
        return new if running is None else torch.maximum(running * self.decay, new)

    def guard(self, wrapped: torch.Tensor) -> None:
        """Grow the scale of the tensors whose part wrapped (x2, at most ``cap``), shrink the others (to 1)."""
        wrapped = wrapped > 0
        if self.per_model:
            wrapped = wrapped.any().expand(self.count)
        grown = (self.scale * 2.0).clamp_max(self.cap)
        shrunk = (self.scale * self.shrink).clamp_min(1.0)
        self.scale = torch.where(wrapped, grown, shrunk)

    def theta(self) -> torch.Tensor:
        """theta of every tensor for the next step (float64)."""
        if self.fixed is not None:
            return self.scale * self.fixed
        if self.distance is not None:
            return (self.distance + self.bound * self.parts) * (2.0 * self.c) * self.scale
        return self.bound * (2.0 * self.c * self.t) * self.scale

    def state_dict(self) -> dict[str, Any]:
        """Running bounds, observed distances and guard scales."""
        out = {"bound": None if self.bound is None else self.bound.clone(), "scale": self.scale.clone()}
        if self.observed:
            out["distance"] = None if self.distance is None else self.distance.clone()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        bound, scale = state["bound"], state["scale"]
        if scale.numel() != self.count or (bound is not None and bound.numel() != self.count):
            raise ValueError(f"Moniqua state holds theta for {scale.numel()} tensors, the model has {self.count}")
        self.bound = None if bound is None else bound.clone().double()
        self.scale = scale.clone().double()
        if self.observed:
            distance = state.get("distance")
            self.distance = None if distance is None else distance.clone().double()
