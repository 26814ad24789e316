"""Moniqua with one theta for the whole model: the config, theta rule and wrap fingerprint of Moniqua-AD-PSGD.

Lu, De Sa. "Moniqua: Modulo Quantized Communication in Decentralized SGD." ICML 2020.

Moniqua-AD-PSGD (:mod:`.adpsgd`) still sends the whole model with one theta (the synchronous Moniqua and
Moniqua-D² moved to a theta per tensor, see :mod:`.moniqua`). Its pieces live here:

theta (:class:`ThetaRule`): fixed (``theta=0.05``), or ``theta="adaptive"`` (default):
``theta_k = 2 C M_k t_mix``, C = ``theta_c``, M_k a running bound (decay ``theta_decay`` per step) on
the size of the local SGD step ``||alpha (mu buf_i + g_i)||_inf``, ``t_mix = max(1, ln n) / (1 - rho)``
with rho the contraction of the mixing over one period. The adaptive theta never grows by itself; the
guard enlarges its scale (doubling, at most ``theta_cap``) on a wrap and, at 1-2 bits, divides gamma by
the same factor (:func:`keeps_error`) so the quantization error per consensus step stays what it was.

Guard: the message header carries a fingerprint of the grid points the sender recovers from its own
payload (:class:`LatticeFingerprint`); the receiver fingerprints its own recovery. They differ exactly
when some coordinate wrapped, up to a 2^-20 chance that several wraps cancel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Any, Union

import torch

from ..codecs import ModuloCodec
from ..codecs._layout import chunk_elems, chunk_ranges
from .base import AlgorithmConfig, check_range
from .moniqua_theta import THETA_FLOOR, matrix_mixing_time, mixing_time

__all__ = [
    "GUARDS",
    "HEADER_BYTES",
    "IDENTITY_BITS",
    "THETA_FLOOR",
    "LatticeFingerprint",
    "SingleThetaConfig",
    "ThetaBoundError",
    "ThetaRule",
    "coordinate_hashes",
    "default_gamma",
    "inf_norm",
    "keeps_error",
    "int64_bytes",
    "local_step_inf",
    "matrix_mixing_time",
    "mixing_time",
    "payload_slice",
    "read_int64",
]

IDENTITY_BITS = 32
"""``bits`` value meaning "no codec": the fp32 model is sent and x̂_j = x_j exactly."""
MODULO_BITS = (1, 2, 4, 8)
GUARDS = ("resync", "raise")
HEADER_BYTES = 8
_HASH_BITS = 20
_HASH_MASK = (1 << _HASH_BITS) - 1
_SUM_MASK = (1 << 62) - 1


def keeps_error(codec: ModuloCodec) -> bool:
    """Whether the guard divides gamma when it enlarges theta: when delta B >= theta / 4 (1-2 bits).

    There the quantization error is of the order of the bound itself, and enlarging theta alone enlarges
    the error each consensus step injects (measured: diverged at 1 bit); dividing gamma by the same factor
    keeps gamma * delta * B constant. At 4-8 bits (nearest) delta B <= theta / 15 and gamma is left alone.
    """
    return 2.0 * codec.delta / (1.0 - 2.0 * codec.delta) >= 0.25


def default_gamma(bits: int) -> float:
    """gamma when none is given: 0.5 at 1-2 bits (gamma < 1 is needed there, see the docs), else 1.0."""
    return 0.5 if bits <= 2 else 1.0


class ThetaBoundError(RuntimeError):
    """Moniqua's modulo recovery wrapped (|x_i - x_j|_inf exceeded the range) and ``guard="raise"``."""


@dataclass(frozen=True)
class SingleThetaConfig(AlgorithmConfig):
    """Options of Moniqua with one theta for the whole model (Moniqua-AD-PSGD).

    bits: 1, 2, 4 or 8 (modulo codec) or 32 (identity, full precision). rounding: "nearest" or
    "stochastic" (bits >= 2). gamma: consensus step in (0, 1]; None picks :func:`default_gamma`.
    theta: a number > 0 (fixed) or "adaptive". theta_c: C of the adaptive rule. theta_decay: per-step
    decay of its running gradient bound, in [0, 1]. guard: "resync" or "raise". theta_cap: the most the
    guard may enlarge theta, a factor >= 1.
    """

    bits: int = 1
    rounding: str = "nearest"
    gamma: Union[float, None] = None
    theta: Union[float, str] = "adaptive"
    theta_c: float = 1.0
    theta_decay: float = 0.99
    guard: str = "resync"
    theta_cap: float = 16.0

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.bits, bool) or self.bits not in (*MODULO_BITS, IDENTITY_BITS):
            raise ValueError(f"bits must be one of 1, 2, 4, 8 (modulo codec) or 32 (identity), got {self.bits!r}")
        if self.rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {self.rounding!r}")
        if self.rounding == "stochastic" and self.bits == 1:
            raise ValueError(
                "rounding='stochastic' needs bits >= 2: on a 2-level grid its error is a whole grid step "
                "(delta = 1/2), so B_theta = 2*theta/(1 - 2*delta) is infinite and no model can be recovered; "
                "use rounding='nearest' at 1 bit"
            )
        if self.gamma is None:
            object.__setattr__(self, "gamma", default_gamma(self.bits))
        check_range("gamma", self.gamma, lo=0.0, hi=1.0, lo_open=True)
        if self.theta != "adaptive":
            if isinstance(self.theta, bool) or not isinstance(self.theta, Real) or not (
                math.isfinite(self.theta) and self.theta > 0
            ):
                raise ValueError(f"theta must be 'adaptive' or a finite number > 0, got {self.theta!r}")
        check_range("theta_c", self.theta_c, lo=0.0, lo_open=True)
        check_range("theta_decay", self.theta_decay, lo=0.0, hi=1.0)
        if self.guard not in GUARDS:
            raise ValueError(f"guard must be one of {GUARDS}, got {self.guard!r}")
        check_range("theta_cap", self.theta_cap, lo=1.0)


class ThetaRule:
    """theta for the next step: fixed, or adaptive ``2 C M t_mix`` (non-increasing); times the guard's scale."""

    def __init__(self, config: SingleThetaConfig, t_mix: float):
        self.fixed = None if config.theta == "adaptive" else float(config.theta)
        self.c, self.decay, self.cap, self.t_mix = config.theta_c, config.theta_decay, config.theta_cap, t_mix
        self.bound: float | None = None  # running bound M on the agreed local-step size
        self.base: float | None = None  # adaptive theta before the guard's scale
        self.scale = 1.0

    def ready(self) -> bool:
        """Whether theta is known (adaptive needs one observation first)."""
        return self.fixed is not None or self.base is not None

    def observe(self, step_inf: float, x_inf: float) -> None:
        """Fold in one step's max_i local-step size and max_i ||x_i||_inf (identical on every rank)."""
        self.bound = step_inf if self.bound is None else max(self.decay * self.bound, step_inf)
        if self.fixed is None:
            wanted = 2.0 * self.c * self.bound * self.t_mix
            base = wanted if self.base is None else min(self.base, wanted)
            self.base = max(base, THETA_FLOOR * x_inf, 1e-30)

    def theta(self) -> float:
        """theta of the next step."""
        return (self.base if self.fixed is None else self.fixed) * self.scale

    def enlarge(self) -> float:
        """Double the scale, up to ``theta_cap``; return the factor actually applied (1.0 at the cap)."""
        new = min(2.0 * self.scale, self.cap)
        factor, self.scale = new / self.scale, new
        return factor

    def state_dict(self) -> dict[str, Any]:
        """Running bound, adaptive base and the guard's scale."""
        return {"bound": self.bound, "base": self.base, "scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.bound, self.base, self.scale = state["bound"], state["base"], float(state["scale"])


def coordinate_hashes(start: int, stop: int) -> torch.Tensor:
    """Odd 20-bit pseudo-random weights of coordinates ``start..stop-1`` (an LCG's high bits), int64."""
    c = torch.arange(start, stop, dtype=torch.int64).bitwise_and_((1 << 31) - 1)
    return c.mul_(1103515245).add_(12345).bitwise_and_((1 << 31) - 1).bitwise_right_shift_(11).bitwise_or_(1)


def payload_slice(payload: torch.Tensor, bits: int, start: int, stop: int) -> torch.Tensor:
    """The bytes of a packed payload holding coordinates ``start..stop-1`` (``start`` a multiple of 8)."""
    return payload[start * bits // 8:(stop * bits + 7) // 8]


class LatticeFingerprint:
    """Fingerprint of the grid points a modulo recovery landed on; two recoveries of one payload match iff no wrap.

    Every recovered value is ``B * (offset + L / 2^b)`` for an integer L (``offset`` is probed from the
    codec, so its grid convention is not restated here). The fingerprint is
    ``sum_c H_c * (L_c mod 2^20)  mod 2^62`` with odd pseudo-random 20-bit H_c: exact integer arithmetic
    (chunk sums < 2^62), so sender and receiver agree bit for bit unless some L_c differs. A wrap changes
    L_c by a multiple of 2^b; cancelling wraps go unnoticed with probability about 2^-20.
    """

    def __init__(self, codec: ModuloCodec, chunk: int):
        probe = codec.decode(torch.zeros(codec.payload_bytes(1), dtype=torch.uint8), torch.zeros(1), 1.0)
        self.codec, self.chunk_size = codec, chunk
        self.levels = float(1 << codec.bits)
        self.shift = float(probe[0]) * self.levels

    def chunk(self, x_hat: torch.Tensor, hashes: torch.Tensor, B: float) -> int:
        """The (unreduced) contribution of one recovered chunk, given its coordinates' ``hashes``."""
        grid = x_hat.double().mul_(self.levels / B).sub_(self.shift).round_().long().bitwise_and_(_HASH_MASK)
        return int(grid.mul_(hashes).sum())

    def of(self, payload: torch.Tensor, reference: torch.Tensor, B: float) -> tuple[int, float]:
        """Fingerprint of ``decode(payload, reference, B)`` and its max distance to ``reference``, chunk by chunk."""
        total, distance, bits = 0, 0.0, self.codec.bits
        for start, stop in chunk_ranges(reference.numel(), self.chunk_size):
            ref = reference[start:stop]
            x_hat = self.codec.decode(payload_slice(payload, bits, start, stop), ref, B)
            total += self.chunk(x_hat, coordinate_hashes(start, stop), B)
            distance = max(distance, float(x_hat.sub_(ref).abs_().max()))
        return total & _SUM_MASK, distance


def inf_norm(t: torch.Tensor) -> float:
    """``||t||_inf`` as a float (0 for an empty tensor)."""
    return float(torch.linalg.vector_norm(t, ord=math.inf)) if t.numel() else 0.0


def int64_bytes(value: int) -> torch.Tensor:
    """The 8 bytes of ``value`` as an int64 (a message header field)."""
    return torch.tensor([value], dtype=torch.int64).view(torch.uint8)


def read_int64(row: torch.Tensor) -> int:
    """The int64 stored in the first 8 bytes of the uint8 tensor ``row``."""
    return int(row[:HEADER_BYTES].cpu().clone().view(torch.int64)[0])


def local_step_inf(grad: torch.Tensor, lr: float, optimizer: torch.optim.SGD | None = None) -> float:
    """``||lr (mu buf + grad)||_inf``: the size of the local SGD step about to be taken (theta's statistic).

    ``buf`` is the optimizer's momentum buffer (torch SGD: buf <- mu buf + grad, then x -= lr buf); without
    momentum (or before its first step) this is ``lr ||grad||_inf``. Computed chunk by chunk.
    """
    mu, buf = 0.0, None
    if optimizer is not None:
        group = optimizer.param_groups[0]
        mu = group["momentum"]
        buf = optimizer.state.get(group["params"][0], {}).get("momentum_buffer") if mu else None
    if buf is None:
        return lr * inf_norm(grad)
    chunk = chunk_elems(grad.device)
    return lr * max((inf_norm(torch.add(grad[s:e], buf[s:e], alpha=mu)) for s, e in chunk_ranges(grad.numel(), chunk)),
                    default=0.0)
