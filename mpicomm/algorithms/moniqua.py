"""Moniqua on D-PSGD: modulo-quantized gossip, plus the theta rule and guard its variants share.

Lu, De Sa. "Moniqua: Modulo Quantized Communication in Decentralized SGD." ICML 2020.

Step k on rank i (W the mixing matrix of ``comm.topology(k)``, N(i) its in-neighbours plus i itself,
B = B_theta = 2 theta / (1 - 2 delta), Q the b-bit quantizer of ``ModuloCodec``)::

    q_i  = Q(cmod(x_i / B, 1))                       b bits per coordinate, sent to the out-neighbours
    x̂_j = cmod(q_j B - x_i, B) + x_i                for every j in N(i), including j = i
    x_i <- x_i + gamma * sum_j W_ij (x̂_j - x̂_i) - alpha g_i      (torch SGD step; momentum if set)

``bits=32`` is the identity: x̂_j = x_j exactly, the fp32 model is sent, and with gamma = 1 the mixing
runs through D-PSGD's own ``gossip_average``, so Moniqua(bits=32, gamma=1) *is* ``dpsgd`` bit for bit.
gamma defaults to 0.5 at 1-2 bits (gamma < 1 is needed there, docs/ALGORITHMS.md) and 1 otherwise.

theta (:class:`ThetaRule`): fixed (``theta=0.05``), or ``theta="adaptive"`` (default):
``theta_k = 2 C M_k t_mix``, C = ``theta_c`` (default 1), M_k a running bound (decay ``theta_decay``
per step) on ``max_i ||alpha (mu buf_i + g_i)||_inf``, the size of the local SGD step (momentum buffer
included), and ``t_mix = max(1, ln n) / (1 - rho)``, rho the contraction of the damped mixing
``(1 - gamma) I + gamma W`` over one period of the schedule. Why: two neighbours' local steps can push
them 2 M apart per step and gossip removes a fraction 1 - rho of the disagreement per step, so it
settles near 2 M / (1 - rho); log n is the paper's allowance for the max over coordinates and ranks.
The adaptive theta never grows by itself (theta_k <= theta_{k-1}, except to stay above the floor): it
shrinks as gradients do and grows only when the guard sees evidence. Following a growing gradient is
a positive feedback at low bit widths: the quantization error (delta B = theta at 1 bit) kicks the
model, the gradient grows, theta grows (measured in simulation: 1 and 2 bits on 8-rank rings
diverged). The floor ``2^-12 max_i ||x_i||_inf`` keeps the grid well above float32 resolution. Every
input of theta is agreed by one allreduce(max) per step, so theta is identical on every rank.

Guard (cheap and exact): each message carries an 8-byte header, a fingerprint of the grid points the
sender recovers from its own payload (:class:`LatticeFingerprint`); each receiver fingerprints its own
recovery of that payload. They differ exactly when some coordinate wrapped (|x_i - x_j| went past the
modulo range), up to a 2^-20 chance that several wraps cancel. The wrap count rides on the per-step
allreduce, so every rank learns it at once. ``guard="raise"`` then raises :class:`ThetaBoundError` on
every rank; ``guard="resync"`` (default) logs a warning with the step and the measured max
|x_i - x_j|_inf, runs one full-precision D-PSGD mixing round, doubles theta's scale (at most
``theta_cap``, default 16, in all) and, at 1-2 bits, divides gamma by the same factor so that the
quantization error each consensus step injects, gamma delta B, stays what it was (:func:`keeps_error`;
enlarging theta alone diverged at 1 bit in simulation). At the cap theta stops growing; each further
wrap costs one full-precision round and a warning: training goes on at D-PSGD quality, never on silent
garbage. The step that detects a wrap has already applied its update; a wrapped coordinate's consensus
term is still bounded by gamma (1 - W_ii) B, and the resync round that follows averages it.

Memory beyond the model: no model-sized buffer. Persistent: the send buffer (8 + ceil(d b / 8) bytes)
and the receive rows (in-degree x the same), against D-PSGD's in-degree x 4d bytes of receive rows.
Transient per step: chunk-sized float temporaries (at most 2^18 elements each on a CPU); a resync round
allocates D-PSGD's fp32 receive rows for its duration only.

Traffic per step: (8 + ceil(d b / 8)) bytes to each out-neighbour in one neighbour collective, plus an
allreduce of 4 float64 (32 bytes; booked by the Ledger as 2 (n - 1) / n x 32). bits=32: 4d per neighbour.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from numbers import Real
from typing import Any, Union

import numpy as np
import torch

from ..codecs import ModuloCodec
from ..codecs._layout import chunk_elems, chunk_ranges
from .base import Algorithm, AlgorithmConfig, check_range, clone_optimizer_state
from .dpsgd import gossip_average
from .registry import register

__all__ = [
    "GUARDS",
    "HEADER_BYTES",
    "IDENTITY_BITS",
    "THETA_FLOOR",
    "LatticeFingerprint",
    "Moniqua",
    "MoniquaConfig",
    "ModuloGossip",
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

log = logging.getLogger(__name__)

IDENTITY_BITS = 32
"""``bits`` value meaning "no codec": the fp32 model is sent and x̂_j = x_j exactly."""
MODULO_BITS = (1, 2, 4, 8)
GUARDS = ("resync", "raise")
HEADER_BYTES = 8
THETA_FLOOR = 2.0**-12
"""Adaptive theta is at least this times max_i ||x_i||_inf (8-bit grid >= 16 float32 ulps)."""
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
class MoniquaConfig(AlgorithmConfig):
    """Moniqua options.

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


class ThetaRule:
    """theta for the next step: fixed, or adaptive ``2 C M t_mix`` (non-increasing); times the guard's scale."""

    def __init__(self, config: MoniquaConfig, t_mix: float):
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


class ModuloGossip:
    """Moniqua's mixing ``x <- x + gamma sum_j W_ij (x̂_j - x̂_i)`` on one rank, with its theta rule and guard."""

    def __init__(self, comm, config: MoniquaConfig, numel: int, device: torch.device):
        self.comm, self.config, self.numel = comm, config, numel
        self.gamma = config.gamma
        self.identity = config.bits == IDENTITY_BITS
        self.resyncs = 0
        self.last: dict[str, float] = {}
        if self.identity:
            return
        self.codec = ModuloCodec(config.bits, config.rounding, seed=config.seed + comm.rank)
        self.chunk = chunk_elems(device)
        self.fingerprint = LatticeFingerprint(self.codec, self.chunk)
        self.rule = ThetaRule(config, mixing_time(comm.schedule, config.gamma))
        self.payload_bytes = self.codec.payload_bytes(numel)
        self.send = torch.empty(HEADER_BYTES + self.payload_bytes, dtype=torch.uint8, device=device)

    def mix(self, x: torch.Tensor, step: int, step_inf: float) -> bool:
        """One mixing round over ``comm.topology(step)`` on ``x`` (in place); True if the guard resynced.

        ``step_inf`` is the size of this rank's local step (:func:`local_step_inf`), the adaptive theta's statistic.
        """
        topo = self.comm.topology(step)
        rank = self.comm.rank
        if self.identity:
            rows = self.comm.neighbor_allgather(x, step=step)
            _gossip(x, rows, topo.self_weight(rank), topo.neighbor_weights(rank), self.gamma)
            return False
        if not self.rule.ready():
            self.rule.observe(*self._agree_max([step_inf, inf_norm(x)]))
        theta = self.rule.theta()
        B = self.codec.b_theta(theta)
        payload = self.codec.encode(x, B)
        self.send[:HEADER_BYTES].copy_(int64_bytes(self.fingerprint.of(payload, x, B)[0]))
        self.send[HEADER_BYTES:].copy_(payload)
        rows = self.comm.neighbor_allgather(self.send, step=step)
        recovered, fingerprints = self._recover_and_mix(x, payload, rows, topo.neighbor_weights(rank), B)
        wrapped = sum(int(fp != read_int64(row)) for fp, row in zip(fingerprints, rows))
        agreed = self._agree_max([wrapped, step_inf, recovered, inf_norm(x)])
        self.rule.observe(agreed[1], agreed[3])
        self.last = {"theta": theta, "B": B, "recovered_distance": agreed[2], "wrapped_edges": agreed[0]}
        if agreed[0] > 0:
            self._violation(x, step, theta, B, int(agreed[0]), agreed[2])
        return agreed[0] > 0

    # ------------------------------------------------------------------ the two passes
    def _recover_and_mix(self, x, payload, rows, weights, B) -> tuple[float, list[int]]:
        """Chunk by chunk: recover self and neighbours, fingerprint, x += gamma (sum_j W_ij x̂_j - sum_j W_ij x̂_i)."""
        size = min(self.chunk, self.numel)
        own = torch.empty(size, dtype=torch.float32, device=x.device)
        other, acc = torch.empty_like(own), torch.empty_like(own)
        wsum, bits = math.fsum(weights), self.config.bits
        fingerprints, recovered = [0] * len(weights), 0.0
        for start, stop in chunk_ranges(self.numel, self.chunk):
            m, xc = stop - start, x[start:stop]
            hashes = coordinate_hashes(start, stop)
            self.codec.decode(payload_slice(payload, bits, start, stop), xc, B, out=own[:m])
            acc[:m].zero_()
            for k, (w, row) in enumerate(zip(weights, rows)):
                nb = self.codec.decode(payload_slice(row[HEADER_BYTES:], bits, start, stop), xc, B, out=other[:m])
                fingerprints[k] += self.fingerprint.chunk(nb, hashes, B)
                acc[:m].add_(nb, alpha=w)
                recovered = max(recovered, float(nb.sub_(xc).abs_().max()))
            acc[:m].sub_(own[:m], alpha=wsum)
            xc.add_(acc[:m], alpha=self.gamma)
        return recovered, [fp & _SUM_MASK for fp in fingerprints]

    # ------------------------------------------------------------------ guard
    def _violation(self, x, step, theta, B, wrapped, recovered) -> None:
        what = (f"Moniqua step {step}: the modulo recovery wrapped on {wrapped} incoming edge(s) of the worst rank "
                f"(|x_i - x_j|_inf exceeded the range; theta={theta:.4g}, B={B:.4g}, largest recovered "
                f"distance {recovered:.4g})")
        if self.config.guard == "raise":
            raise ThetaBoundError(what + "; raise theta or theta_c, or use guard='resync'")
        topo = self.comm.topology(step)
        rank = self.comm.rank
        rows = torch.empty((len(topo.in_neighbors(rank)), self.numel), dtype=x.dtype, device=x.device)
        self.comm.neighbor_allgather(x, out=rows, step=step)
        distance = max((_inf_distance(row, x, self.chunk) for row in rows), default=0.0)
        gossip_average(x, rows, topo.self_weight(rank), topo.neighbor_weights(rank))
        del rows
        distance = self._agree_max([distance])[0]
        factor = self.rule.enlarge()
        if keeps_error(self.codec):
            self.gamma /= factor
        self.resyncs += 1
        self.last["true_distance"] = distance
        log.warning("%s; measured max |x_i - x_j|_inf = %.4g; ran a full-precision round; theta scale -> %g%s, "
                    "gamma -> %.4g", what, distance, self.rule.scale, " (cap)" if factor == 1.0 else "", self.gamma)

    def _agree_max(self, values) -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        return self.comm.allreduce(t, "max").tolist()

    # ------------------------------------------------------------------ state and stats
    def stats(self) -> dict[str, Any]:
        """theta, B, gamma, guard scale and counters of the last step."""
        if self.identity:
            return {"gamma": self.gamma}
        return {"gamma": self.gamma, "theta_scale": self.rule.scale, "resyncs": self.resyncs, **self.last}

    def state_dict(self) -> dict[str, Any]:
        """gamma (the guard lowers it), counters, the theta rule and the codec's generator."""
        out: dict[str, Any] = {"gamma": self.gamma, "resyncs": self.resyncs}
        if not self.identity:
            out.update(rule=self.rule.state_dict(), codec=self.codec.state_dict())
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.gamma, self.resyncs = float(state["gamma"]), int(state["resyncs"])
        if not self.identity:
            self.rule.load_state_dict(state["rule"])
            self.codec.load_state_dict(state["codec"])


def _gossip(x, rows, self_weight, weights, gamma) -> None:
    """``x <- x + gamma sum_j W_ij (x_j - x)``; at gamma = 1 exactly D-PSGD's ``gossip_average``."""
    if gamma != 1.0:
        self_weight = 1.0 - gamma * (1.0 - self_weight)
        weights = [gamma * w for w in weights]
    gossip_average(x, rows, self_weight, weights)


def inf_norm(t: torch.Tensor) -> float:
    """``||t||_inf`` as a float (0 for an empty tensor)."""
    return float(torch.linalg.vector_norm(t, ord=math.inf)) if t.numel() else 0.0


def _inf_distance(a: torch.Tensor, b: torch.Tensor, chunk: int) -> float:
    return max((inf_norm(a[s:e] - b[s:e]) for s, e in chunk_ranges(a.numel(), chunk)), default=0.0)


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


@register
class Moniqua(Algorithm):
    """Moniqua on D-PSGD: modulo-quantized neighbour averaging with step gamma, then a local SGD step."""

    name = "moniqua"
    config_class = MoniquaConfig

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        self.optimizer = self._local_sgd()
        self.gossip = ModuloGossip(comm, self.config, self.flat.numel, self.flat.data.device)

    def _step(self, grad: torch.Tensor) -> None:
        self._decayed(grad)
        size = local_step_inf(grad, self.lr, self.optimizer) if not self.gossip.identity else 0.0
        self.gossip.mix(self.flat.data, self.step_count, size)
        self._sgd_step(self.optimizer, self.lr)

    def stats(self) -> dict[str, Any]:
        """Base stats plus theta, B, gamma and the guard's counters."""
        return {**super().stats(), **self.gossip.stats()}

    def _extra_state(self):
        return {"optimizer": clone_optimizer_state(self.optimizer), "gossip": self.gossip.state_dict()}

    def _load_extra_state(self, extra):
        self.optimizer.load_state_dict(extra["optimizer"])
        self.gossip.load_state_dict(extra["gossip"])
