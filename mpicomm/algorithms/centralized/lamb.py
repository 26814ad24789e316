"""LAMB on the averaged gradient: Adam's moments with a layer-wise trust ratio.

You, Li, Reddi, Hseu, Kumar, Bhojanapalli, Song, Demmel, Keutzer, Hsieh. "Large Batch Optimization
for Deep Learning: Training BERT in 76 minutes", ICLR 2020.

Every step t on every rank (g the fp32-allreduced mean gradient; per layer l, i.e. per parameter tensor
of the flat buffer; no bias correction, as DeepSpeed's LAMB)::

    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
    update_l = m_l / (sqrt(v_l) + eps) + wd x_l
    r_l = clip(||x_l|| / ||update_l||, min_coeff, max_coeff)   (1 if either norm is 0)
    x_l <- x_l - lr r_l update_l;        rbar_l <- coeff_beta rbar_l + (1 - coeff_beta) r_l

One fp32 allreduce per step. ``optimizer=`` and ``clip_grad_norm_`` are refused: the trust ratio is the
method. rbar feeds 1-bit LAMB's frozen ratios (:mod:`..onebit.lamb`); see ``docs/algorithms/centralized.md``.

``hierarchical`` (auto: on over several nodes of several ranks) sums g in two levels, as AllReduce-SGD does
(:mod:`~mpicomm.algorithms.shared.hierarchy`): exact sums, so the flat step up to the order of float32
additions. (1-bit LAMB's warm-up, which runs this code, stays flat.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Algorithm, check_range
from ..shared.hierarchy import HierarchicalConfig, mean_over_ranks, two_level_for
from .adam import AdamConfig

__all__ = ["LAMB", "LAMBConfig", "LAMBTwoLevelConfig"]


@dataclass(frozen=True)
class LAMBConfig(AdamConfig):
    """Adam options plus the trust ratio's clip and average; ``lr`` defaults to 1e-2 (the trust ratio makes it
    the relative change of each layer per step).

    min_coeff: the smallest trust ratio r_l, > 0. max_coeff: the largest, >= min_coeff. coeff_beta: decay of
    the running average rbar_l of r_l, in [0, 1).
    """

    lr: float = 1e-2
    max_coeff: float = 10.0
    min_coeff: float = 0.01
    coeff_beta: float = 0.9

    def __post_init__(self):
        super().__post_init__()
        check_range("min_coeff", self.min_coeff, lo=0.0, lo_open=True)
        check_range("max_coeff", self.max_coeff, lo=self.min_coeff)
        check_range("coeff_beta", self.coeff_beta, lo=0.0, hi=1.0, hi_open=True)


@dataclass(frozen=True)
class LAMBTwoLevelConfig(LAMBConfig, HierarchicalConfig):
    """LAMB options: Adam's, the trust ratio's and hierarchical (LAMBConfig first, so that its ``lr`` default
    is LAMB's: see AllReduceAdamConfig)."""


class LAMB(Algorithm):
    """LAMB (per-layer trust ratio on Adam's update) on the gradient averaged by one fp32 allreduce."""

    name = "lamb"
    config_class = LAMBTwoLevelConfig
    centralized = True
    optimizer_refusal = "its layer-wise trust ratio is the method; set lr, beta1, beta2, eps and weight_decay instead"
    builtin_optimizer_fields = ("lr", "weight_decay", "beta1", "beta2", "eps")
    masks_unreached = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        x = self.flat.data
        self.m, self.v, self._denom, self._update = (torch.zeros_like(x) for _ in range(4))
        self.layers = [(layer.offset, layer.offset + layer.numel) for layer in self.flat.layers]
        self.coeff_freeze = torch.zeros(len(self.layers), dtype=torch.float64)  # rbar_l
        self.last_coeffs = torch.ones(len(self.layers), dtype=torch.float64)    # r_l (or rbar_l f_l) of the last step
        self.two_level = two_level_for(self.config, comm, self.flat.numel, self.flat.grad)

    def _step(self, grad: torch.Tensor) -> None:
        self._lamb_step(grad)

    def _lamb_step(self, grad: torch.Tensor) -> None:
        """Average ``grad`` over all ranks, update m and v, take the per-layer trust-ratio step."""
        cfg, x = self.config, self.flat.data
        mean_over_ranks(grad, self.comm, self.two_level)
        self.m.lerp_(grad, 1 - cfg.beta1)
        self.v.mul_(cfg.beta2).addcmul_(grad, grad, value=1 - cfg.beta2)
        torch.sqrt(self.v, out=self._denom).add_(cfg.eps)
        update = torch.div(self.m, self._denom, out=self._update)
        if cfg.weight_decay:
            update.add_(x, alpha=cfg.weight_decay)
        for k, (lo, hi) in enumerate(self.layers):
            w_norm, u_norm = float(x[lo:hi].norm()), float(update[lo:hi].norm())
            ratio = min(max(w_norm / u_norm, cfg.min_coeff), cfg.max_coeff) if w_norm and u_norm else 1.0
            self.coeff_freeze[k] = cfg.coeff_beta * self.coeff_freeze[k] + (1 - cfg.coeff_beta) * ratio
            self.last_coeffs[k] = ratio
            x[lo:hi].add_(update[lo:hi], alpha=-self.lr * ratio)

    def _zero_unreached(self, reached):
        """m and v where no gradient has reached (zero already after exact averages; not after 1-bit ones)."""
        reached.zero(self.m)
        reached.zero(self.v)

    def stats(self):
        """Base stats plus the smallest and largest per-layer coefficient of the last step."""
        out = super().stats()
        out.update(min_layer_coeff=float(self.last_coeffs.min()), max_layer_coeff=float(self.last_coeffs.max()))
        return out

    def _extra_state(self):
        return {"m": self.m.clone(), "v": self.v.clone(), "coeff_freeze": self.coeff_freeze.clone(),
                "last_coeffs": self.last_coeffs.clone()}

    def _load_extra_state(self, extra):
        for key in ("m", "v", "coeff_freeze", "last_coeffs"):
            getattr(self, key).copy_(extra[key])
