"""1-bit LAMB: LAMB warm-up, then 1-bit averaged momentum with frozen variance and frozen layer ratios.

Li, Awan, Tang, Zhang, Zhang, He. "1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training
with LAMB's Convergence Speed", HiPC 2022 (arXiv:2104.06069), in the form of DeepSpeed's ``OnebitLamb``.

``lamb`` (:mod:`..centralized.lamb`, the same code) for t <= freeze_step, v_fresh = v at t = freeze_step
(``freeze_step`` as given; with ``total_steps`` alone, decided while training: the first step past 20 % of the
run at which the variance has settled, 50 % at the latest, :mod:`~mpicomm.algorithms.onebit.freeze`; with
neither, DeepSpeed's 100,000);
then v is frozen and, on rank i (the error-compensated 1-bit average of :mod:`.average`)::

    s_l = mean_k(rms(m_k)) / rms(m_l)          once, at the first compression step
    m   <- OneBitAverage((b1 m + (1 - b1) g_i) * s) / s
    g~  = (m - b1 m_prev) / (1 - b1);   v_fresh <- b2 v_fresh + (1 - b2) g~^2
    f_l = max_j (max(sqrt(v_l), F) + eps)_j / (max(sqrt(v_fresh_l), F) + eps)_j, clipped and rate-limited
    x_l <- x_l - lr rbar_l f_l (m_l / (max(sqrt(v_l), F) + eps) + wd x_l)

F = denominator_floor (default 0.01) times the mean of the frozen sqrt(v) over the model: a coordinate the
warm-up barely saw (v ~ 0), whose 1-bit momentum is never zero, moves by about lr rbar_l f_l / denominator_floor
and not by that times scale / eps; floored in both denominators, it cannot raise f_l
(:mod:`~mpicomm.algorithms.onebit.floor`). 0 is the published method. A weight no gradient has reached is not
moved and its moments stay zero (:mod:`~mpicomm.algorithms.shared.reached`); one first reached after the freeze
gets the mean v of its tensor's coordinates reached before, instead of the floor.

Per step: one fp32 allreduce while warming up, then one 1-bit average. ``hierarchical`` (auto: on over
several nodes of several ranks): the allreduce in two exact levels, the 1-bit average between nodes of each
node's exact mean per local rank's shard (:class:`~mpicomm.algorithms.onebit.average.NodeOneBitAverage`).
Differences from DeepSpeed's code and the weight-decay form of f_l: ``docs/algorithms/centralized.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...checkpoint.resize_rules import ONEBIT_RULES, replica_mean
from ...codecs.base import check_float32
from ..base import check_int, check_range
from ..centralized.lamb import LAMB, LAMBTwoLevelConfig
from .average import onebit_average_for
from .floor import DenominatorFloorConfig, raise_to_floor
from .freeze import FreezePolicy

__all__ = ["OneBitLAMB", "OneBitLAMBConfig"]


@dataclass(frozen=True)
class OneBitLAMBConfig(LAMBTwoLevelConfig, DenominatorFloorConfig):
    """LAMB options plus the warm-up length, the factor clip of the compression stage, hierarchical and the
    denominator's floor.

    freeze_step: LAMB steps before the variance freezes and compression starts, >= 1 (None: decided while
    training when total_steps is given, else DeepSpeed's 100,000). total_steps: the run's length (the apps fill it
    in). factor_min: the
    smallest scaling factor f_l of the frozen ratio. factor_max: the largest, >= factor_min.
    factor_threshold: the most f_l may change from one step to the next, relatively (>= 0).
    """

    freeze_step: int | None = None
    total_steps: int | None = None
    factor_max: float = 4.0
    factor_min: float = 0.5
    factor_threshold: float = 0.1

    def __post_init__(self):
        super().__post_init__()
        if self.freeze_step is not None:
            check_int("freeze_step", self.freeze_step, 1)
        if self.total_steps is not None:
            check_int("total_steps", self.total_steps, 1)
            if self.freeze_step is not None and self.freeze_step >= self.total_steps:
                raise ValueError(f"onebit_lamb: freeze_step ({self.freeze_step}) must be below total_steps "
                                 f"({self.total_steps}), or the run never compresses; leave freeze_step unset to "
                                 "freeze once the variance has settled")
        check_range("factor_min", self.factor_min, lo=0.0, lo_open=True)
        check_range("factor_max", self.factor_max, lo=self.factor_min)
        check_range("factor_threshold", self.factor_threshold, lo=0.0)


class OneBitLAMB(LAMB):
    """1-bit LAMB: LAMB warm-up, then 1-bit averaged momentum with frozen v and frozen, rescaled layer ratios."""

    name = "onebit_lamb"
    config_class = OneBitLAMBConfig
    resize_sharded = True
    optimizer_refusal = ("1-bit LAMB's compressed momentum and frozen trust ratios are the method; set lr, "
                         "beta1, beta2, eps and weight_decay instead")

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        check_float32(self.name, self.flat.data, "the sign codec decodes to float32")
        x = self.flat.data
        self.v_fresh, self.m_prev, self.scaling = (torch.zeros_like(x) for _ in range(3))
        self.onebit = onebit_average_for(self.two_level, self.comm, self.flat.numel, x.device, one_worker_scale=True)
        self.last_factor = torch.ones(len(self.layers), dtype=torch.float64)
        self._scaled = False
        cfg = self.config
        fixed = cfg.freeze_step if cfg.freeze_step is not None or cfg.total_steps is not None else 100_000
        self.policy = FreezePolicy(self.name, fixed, cfg.total_steps)
        self.freeze_step = fixed  # None until the policy decides it

    @property
    def phase(self) -> str:
        """``"warmup"`` or ``"compression"``: the phase the next :meth:`step` runs in."""
        return "warmup" if self.freeze_step is None or self.step_count < self.freeze_step else "compression"

    def _step(self, grad: torch.Tensor) -> None:
        if self.phase == "warmup":
            self._lamb_step(grad)
            t = self.step_count + 1
            if self.policy.decide(t, self.v, self.config.beta2):
                self.freeze_step = t
                self.v_fresh.copy_(self.v)
        else:
            self._compressed_step(grad)

    def _set_scaling(self) -> None:
        """s_l = mean_k rms(m_k) / rms(m_l), once (from the momentum at the end of the warm-up)."""
        rms = [float(self.m[lo:hi].norm()) / (hi - lo) ** 0.5 for lo, hi in self.layers]
        united = sum(rms) / len(rms)
        for (lo, hi), r in zip(self.layers, rms):
            self.scaling[lo:hi] = united / r if r else 1.0
        self._scaled = True

    def _compressed_step(self, grad: torch.Tensor) -> None:
        cfg, x = self.config, self.flat.data
        if not self._scaled:
            self._set_scaling()
        self.m_prev.copy_(self.m)
        momentum = self.onebit.input
        torch.lerp(self.m, grad, 1 - cfg.beta1, out=momentum).mul_(self.scaling)
        torch.div(self.onebit.average(), self.scaling, out=self.m)
        g = torch.sub(self.m, self.m_prev, alpha=cfg.beta1, out=grad).div_(1 - cfg.beta1)   # reconstructed g
        self.v_fresh.mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
        floor = raise_to_floor(torch.sqrt(self.v, out=self._denom), cfg.denominator_floor)
        self._denom.add_(cfg.eps)
        prelim = torch.div(self.m, self._denom, out=self._update)
        fresh = torch.sqrt(self.v_fresh, out=grad).clamp_(min=floor).add_(cfg.eps)   # g is no longer needed
        for k, (lo, hi) in enumerate(self.layers):
            factor = float((self._denom[lo:hi] / fresh[lo:hi]).max())
            update = prelim[lo:hi]
            if cfg.weight_decay:
                p_norm = float(update.norm())
                update = update + cfg.weight_decay * x[lo:hi]
                u_norm = float(update.norm())
                q = min(1.0, p_norm / u_norm) if u_norm else 1.0
                factor = factor * q + (1.0 - q)
            factor = min(max(factor, cfg.factor_min), cfg.factor_max)
            last = float(self.last_factor[k])
            factor = min(max(factor, last * (1.0 - cfg.factor_threshold)), last * (1.0 + cfg.factor_threshold))
            self.last_factor[k] = factor
            coeff = float(self.coeff_freeze[k]) * factor
            self.last_coeffs[k] = coeff
            x[lo:hi].add_(update, alpha=-self.lr * coeff)

    def _newly_reached(self, index):
        """In the compression phase, a coordinate first reached now had v = 0 at the freeze: its v and fresh v
        become the mean of its tensor's coordinates reached before, not the floor's."""
        if self.phase != "compression":
            return
        for values in (self.v, self.v_fresh):
            self.reached.fill_with_tensor_means(values, index, self.reached.before)

    def _zero_unreached(self, reached):
        """LAMB's m and v, and the fresh variance the reconstructed gradient feeds, where no gradient has reached."""
        super()._zero_unreached(reached)
        reached.zero(self.v_fresh)

    def stats(self):
        """LAMB's stats plus ``phase`` (of the next step)."""
        return {**super().stats(), "phase": self.phase}

    def metrics(self):
        """When the variance froze (None while warming up), why, and the typical denominator's last change."""
        return self.policy.metrics()

    def _extra_state(self):
        return {**super()._extra_state(), "v_fresh": self.v_fresh.clone(), "scaling": self.scaling.clone(),
                "scaled": self._scaled, "last_factor": self.last_factor.clone(), "freeze": self.policy.state_dict(),
                **self.onebit.state_dict()}

    def _resize_rules(self):
        """On a resize, the 1-bit average's errors follow :data:`~mpicomm.checkpoint.resize_rules.ONEBIT_RULES`; what
        1-bit LAMB's local steps made differ per rank (the model and its moments) is averaged (:func:`replica_mean`),
        what is identical carried."""
        return {**super()._resize_rules(), "params": replica_mean, "extra": replica_mean, **ONEBIT_RULES}

    def _load_extra_state(self, extra):
        super()._load_extra_state(extra)
        legacy_frozen = self.freeze_step is not None and self.step_count >= self.freeze_step
        self.policy.load_state_dict(extra.get("freeze"), self.step_count, legacy_frozen)
        if self.policy.frozen_at is not None:
            self.freeze_step = self.policy.frozen_at
        self.onebit.load_state_dict(extra)
        for key in ("v_fresh", "scaling", "last_factor"):
            getattr(self, key).copy_(extra[key])
        self._scaled = bool(extra["scaled"])
