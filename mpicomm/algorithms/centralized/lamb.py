"""LAMB on the averaged gradient, and 1-bit LAMB: LAMB warm-up, then 1-bit momentum with frozen layer ratios.

You, Li, Reddi, Hseu, Kumar, Bhojanapalli, Song, Demmel, Keutzer, Hsieh. "Large Batch Optimization
for Deep Learning: Training BERT in 76 minutes", ICLR 2020 (LAMB). Li, Awan, Tang, Zhang, Zhang, He.
"1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training with LAMB's Convergence
Speed", HiPC 2022 (arXiv:2104.06069), in the form of DeepSpeed's ``OnebitLamb``.

``lamb``, every step t on every rank (g the fp32-allreduced mean gradient; per layer l, i.e. per
parameter tensor of the flat buffer; no bias correction, as DeepSpeed's LAMB)::

    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
    update_l = m_l / (sqrt(v_l) + eps) + wd x_l
    r_l = clip(||x_l|| / ||update_l||, min_coeff, max_coeff)   (1 if either norm is 0)
    x_l <- x_l - lr r_l update_l;        rbar_l <- coeff_beta rbar_l + (1 - coeff_beta) r_l

``onebit_lamb``: ``lamb`` for t <= freeze_step (the same code: bit-identical), v_fresh = v at
t = freeze_step; then v is frozen and, on rank i (OneBitAverage: the two-sided error-compensated 1-bit
average of :mod:`.onebit`, one worker scale as DeepSpeed's)::

    s_l = mean_k(rms(m_k)) / rms(m_l)          once, at the first compression step (rms = ||.|| / sqrt(len))
    m   <- OneBitAverage((b1 m + (1 - b1) g_i) * s) / s       (momenta brought to one scale first)
    g~  = (m - b1 m_prev) / (1 - b1);   v_fresh <- b2 v_fresh + (1 - b2) g~^2
    update_l = m_l / (sqrt(v_l) + eps) + wd x_l
    f_l = max_j (sqrt(v_l) + eps)_j / (sqrt(v_fresh_l) + eps)_j
          (with wd: f_l <- f_l q + 1 - q, q = min(1, ||m_l / (sqrt(v_l) + eps)|| / ||update_l||))
    f_l <- clip(f_l, factor_min, factor_max), then within (1 +- factor_threshold) f_l(previous step)
    x_l <- x_l - lr rbar_l f_l update_l

Differences from DeepSpeed's code: its first ``step()`` only sets buffers up; it skips the rbar
update when r_l is exactly 1.0 (here every warm-up step updates rbar); its checkpoints drop the error
buffers (here they are saved, so N + N steps == 2N steps bit for bit).

Bytes per step and rank: warm-up, one fp32 allreduce (2 (n - 1) / n * 4 d sent); compression, one
1-bit average ((n - 1) P sent in the all-to-all, (n - 1) P in the allgather, P = 4 + L/8).

``optimizer=`` is refused (``ValueError``) by both: the layer-wise trust ratio (and 1-bit LAMB's
compressed momentum) is the method; they accept lr, beta1, beta2, eps and weight_decay, and refuse
``clip_grad_norm_``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adam import AdamConfig
from .base import Algorithm, check_range
from .onebit import OneBitAverage
from .powersgd import check_int
from .registry import register

__all__ = ["LAMB", "LAMBConfig", "OneBitLAMB", "OneBitLAMBConfig"]


@dataclass(frozen=True)
class LAMBConfig(AdamConfig):
    """Adam options plus the trust ratio's clip and average.

    min_coeff: the smallest trust ratio r_l, > 0. max_coeff: the largest, >= min_coeff. coeff_beta: decay of
    the running average rbar_l of r_l, in [0, 1).
    """

    max_coeff: float = 10.0
    min_coeff: float = 0.01
    coeff_beta: float = 0.9

    def __post_init__(self):
        super().__post_init__()
        check_range("min_coeff", self.min_coeff, lo=0.0, lo_open=True)
        check_range("max_coeff", self.max_coeff, lo=self.min_coeff)
        check_range("coeff_beta", self.coeff_beta, lo=0.0, hi=1.0, hi_open=True)


@register
class LAMB(Algorithm):
    """LAMB (per-layer trust ratio on Adam's update) on the gradient averaged by one fp32 allreduce."""

    name = "lamb"
    config_class = LAMBConfig
    centralized = True
    optimizer_refusal = "its layer-wise trust ratio is the method; set lr, beta1, beta2, eps and weight_decay instead"
    builtin_optimizer_fields = ("lr", "weight_decay", "beta1", "beta2", "eps")

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        x = self.flat.data
        self.m, self.v, self._denom, self._update = (torch.zeros_like(x) for _ in range(4))
        self.layers = [(layer.offset, layer.offset + layer.numel) for layer in self.flat.layers]
        self.coeff_freeze = torch.zeros(len(self.layers), dtype=torch.float64)  # rbar_l
        self.last_coeffs = torch.ones(len(self.layers), dtype=torch.float64)    # r_l (or rbar_l f_l) of the last step

    def _step(self, grad: torch.Tensor) -> None:
        self._lamb_step(grad)

    def _lamb_step(self, grad: torch.Tensor) -> None:
        """Average ``grad`` over all ranks, update m and v, take the per-layer trust-ratio step."""
        cfg, x = self.config, self.flat.data
        self.comm.allreduce(grad).div_(self.comm.size)
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


@dataclass(frozen=True)
class OneBitLAMBConfig(LAMBConfig):
    """LAMB options plus the warm-up length and the factor clip of the compression stage.

    freeze_step: LAMB steps before the variance freezes and compression starts, >= 1. factor_min: the
    smallest scaling factor f_l of the frozen ratio. factor_max: the largest, >= factor_min.
    factor_threshold: the most f_l may change from one step to the next, relatively (>= 0).
    """

    freeze_step: int = 100_000
    factor_max: float = 4.0
    factor_min: float = 0.5
    factor_threshold: float = 0.1

    def __post_init__(self):
        super().__post_init__()
        check_int("freeze_step", self.freeze_step, 1)
        check_range("factor_min", self.factor_min, lo=0.0, lo_open=True)
        check_range("factor_max", self.factor_max, lo=self.factor_min)
        check_range("factor_threshold", self.factor_threshold, lo=0.0)


@register
class OneBitLAMB(LAMB):
    """1-bit LAMB: LAMB warm-up, then 1-bit averaged momentum with frozen v and frozen, rescaled layer ratios."""

    name = "onebit_lamb"
    config_class = OneBitLAMBConfig
    optimizer_refusal = ("1-bit LAMB's compressed momentum and frozen trust ratios are the method; set lr, "
                         "beta1, beta2, eps and weight_decay instead")

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        if self.flat.data.dtype != torch.float32:
            raise TypeError(f"onebit_lamb needs float32 parameters (the sign codec decodes to float32), "
                            f"got {self.flat.data.dtype}")
        x = self.flat.data
        self.v_fresh, self.m_prev, self.scaling = (torch.zeros_like(x) for _ in range(3))
        self.onebit = OneBitAverage(self.comm, self.flat.numel, x.device, one_worker_scale=True)
        self.last_factor = torch.ones(len(self.layers), dtype=torch.float64)
        self._scaled = False

    @property
    def phase(self) -> str:
        """``"warmup"`` or ``"compression"``: the phase the next :meth:`step` runs in."""
        return "warmup" if self.step_count < self.config.freeze_step else "compression"

    def _step(self, grad: torch.Tensor) -> None:
        if self.phase == "warmup":
            self._lamb_step(grad)
            if self.step_count + 1 == self.config.freeze_step:
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
        torch.sqrt(self.v, out=self._denom).add_(cfg.eps)
        prelim = torch.div(self.m, self._denom, out=self._update)
        fresh = torch.sqrt(self.v_fresh, out=grad).add_(cfg.eps)                # g is no longer needed
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

    def stats(self):
        """LAMB's stats plus ``phase`` (of the next step)."""
        return {**super().stats(), "phase": self.phase}

    def _extra_state(self):
        return {**super()._extra_state(), "v_fresh": self.v_fresh.clone(), "scaling": self.scaling.clone(),
                "scaled": self._scaled, "last_factor": self.last_factor.clone(), **self.onebit.state_dict()}

    def _load_extra_state(self, extra):
        super()._load_extra_state(extra)
        self.onebit.load_state_dict(extra)
        for key in ("v_fresh", "scaling", "last_factor"):
            getattr(self, key).copy_(extra[key])
        self._scaled = bool(extra["scaled"])
