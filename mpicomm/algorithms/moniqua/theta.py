"""Moniqua's theta per tensor: follows each tensor's own local step (so the learning rate), with a guard scale.

For tensor l at step k (inputs agreed by the per-step allreduce(max), so theta is the same everywhere)::

    M_l     <- max(decay M_l, max_i s_{i,l})      s_{i,l} = max(||alpha (mu buf_i + g_i)_l||_inf,
                                                            floor ||x_{i,l}||_inf / (2 C t))
    theta_l  = 2 C M_l t  scale_l                 t = P t_mix (a coordinate is mixed every P-th step)
    scale_l <- min(2 scale_l, cap) if part l wrapped on some edge, else max(shrink scale_l, 1)

``theta="observed"`` replaces the worst-case factor t_mix by the spread the receivers actually see::

    D_l     <- max(decay D_l, max over ranks i and in-neighbours j of ||x̂_j - x_i||_inf on l's part)
    theta_l  = 2 C (D_l + P M_l) scale_l          (the bound rule above until D is first seen)

``per="model"`` is the paper's form (one theta for every tensor). Why these bounds:
``docs/algorithms/moniqua.md``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ...codecs import bitpack

__all__ = ["THETA_FLOOR", "THETA_RULES", "TensorTheta", "local_step_sizes", "matrix_mixing_time", "mixing_time",
           "tensor_inf"]

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


def tensor_inf(flat: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``||t_l||_inf`` of every tensor t_l of the flat vector ``flat`` (sizes ``sizes``), float64 on the host.

    On a CPU (numpy enabled, see :func:`~mpicomm.codecs.bitpack.numpy_enabled`): ``max(max t_l, -min t_l)``
    by one ``reduceat`` each, no temporary of the model's size (7x faster than one ``amax`` per tensor,
    which ``segment_reduce`` and ``vector_norm(ord=inf)`` are slower still). Elsewhere one ``abs`` pass and
    one ``amax`` per tensor. An empty tensor gives -inf; NaN propagates.
    """
    if bitpack.numpy_enabled(flat.device):
        values = flat.detach().numpy()
        starts = np.cumsum([0, *sizes[:-1]])
        full = np.asarray(sizes) > 0
        out = np.full(len(sizes), -np.inf)
        if full.any():
            top = np.maximum.reduceat(values, starts[full])
            out[full] = np.maximum(top, -np.minimum.reduceat(values, starts[full])) + 0.0  # -0.0 -> 0.0
        return torch.from_numpy(out)
    magnitude = flat.detach().abs()
    return torch.stack([t.amax() if t.numel() else t.new_full((), -math.inf)
                        for t in magnitude.split(sizes)]).double().cpu()


def local_step_sizes(grad: torch.Tensor, lr: float, optimizer, sizes: list[int]) -> torch.Tensor:
    """``||lr (mu buf + grad)_l||_inf`` per tensor: the local SGD step about to be taken (theta's statistic).

    ``buf`` is the torch SGD ``optimizer``'s momentum buffer (None, or no momentum: ``lr ||grad_l||_inf``).
    """
    buf, mu = None, 0.0
    if optimizer is not None:
        group = optimizer.param_groups[0]
        mu = group["momentum"]
        buf = optimizer.state.get(group["params"][0], {}).get("momentum_buffer") if mu else None
    step = grad if buf is None else torch.add(grad, buf, alpha=mu)
    return tensor_inf(step, sizes) * lr
