"""Moniqua on D-PSGD: modulo-quantized gossip with a theta per tensor, a shared dither and rotating parts.

Lu, De Sa. "Moniqua: Modulo Quantized Communication in Decentralized SGD." ICML 2020.

Step k on rank i (W the mixing matrix of ``comm.topology(k)``, N(i) its in-neighbours, S_l the part of
tensor l sent at step k (:mod:`.moniqua_parts`), theta_l from :mod:`.moniqua_theta`, the b-bit lattice
codec of :mod:`mpicomm.codecs.lattice` with B_l = 2 theta_l / (1 - 2 delta))::

    q_{i,l} = b-bit code of x_i on S_l (dither u keyed by (seed, k, coordinate))   sent to out-neighbours
    x̂_j    = recovery of q_j from x_i on S_l, for j in N(i) and j = i           (check: nothing touched yet)
    w_l     = max over ranks and edges of [fingerprint of x̂_j on S_l != j's own]  (allreduce(max), with theta's inputs:
              each tensor's local step and, under theta="observed", its largest |x̂_j - x_i| on S_l)
    x_i[S_l] += gamma sum_j W_ij (x̂_j - x̂_i)           only for tensors with w_l = 0 (then mix)
    x_i <- x_i - alpha (mu buf + g)                      torch SGD step

With a user optimizer (``optimizer=opt``) the last line is the optimizer's update at the iterate before
mixing, ``d_i = opt.step(x_i, g_i) - x_i`` (computed on a scratch copy), and theta's statistic is
``||d_i||_inf`` per tensor, the step actually taken::

    x_i <- (x_i after mixing) + d_i

Defaults: 4 bits on a rotating quarter of each tensor (``bits=4, parts=4``: about 1 bit per parameter
per step with headers and the collective), ``gamma=1``, theta per tensor, dither, ``guard="skip"``. The
paper's form (one theta, 1 bit on every coordinate) is ``bits=1, parts=1, theta_per="model",
rounding="nearest", gamma=0.5``. ``bits=32`` (with ``parts=1``) is the identity: the fp32 model is sent
and, with gamma = 1, mixed by D-PSGD's own ``gossip_average``: Moniqua(bits=32, gamma=1) *is* ``dpsgd``
bit for bit.

Why it still converges. Per coordinate, step k mixes with W on the coordinates of the parts sent and with
I elsewhere (and on any part the guard skipped): every step's matrix is doubly stochastic, so the average
is preserved exactly (up to float rounding) and over any P consecutive steps each coordinate is mixed
exactly once by W. Moniqua's convergence theorem for D-PSGD (and the D-PSGD analysis it builds on, Lian
et al. 2017) takes one fixed W with spectral gap 1 - rho; here it is applied to the product over a period
of P steps, which has that gap per period, so the argument holds with t_mix multiplied by P (what changes:
theta's bound and the consensus error grow with P t_mix instead of t_mix). Koloskova et al., "A Unified
Theory of Decentralized SGD with Changing Topology and Local Updates" (ICML 2020) covers such time-varying
doubly stochastic mixing with an expected contraction over tau = P steps. The price is slower consensus,
paid for with 4 bits instead of 1 on the coordinates that are sent: at 1 bit the quantization error is
as large as theta and keeps neighbours about theta apart by itself (issue 13's simulation; the MLP bench),
so the recovery condition |x_i - x_j| < theta fails without any gradient.

Guard, check then mix: every (edge, tensor) is decoded and fingerprinted (one int32 per tensor in the
header, :mod:`.moniqua_guard`) before x is touched; the per-tensor wrap flags ride on the per-step
allreduce(max) with theta's statistics, so every rank skips the same parts and the average stays exact.
``guard="resync"`` then also mixes the wrapped parts at full precision (an fp32 neighbour exchange of just
those parts); ``guard="raise"`` raises :class:`ThetaBoundError` on every rank. A wrap doubles that
tensor's theta scale (at most ``theta_cap``), clean steps shrink it back (``theta_shrink``, not below 1).
Wraps are counted per tensor group (:meth:`Moniqua.metrics`, ``metrics.jsonl``) and summarised once by
rank 0 at the end (:meth:`ModuloGossip.close`), never per step.

Work per step: encode and decode run chunk by chunk over the message's code positions
(:meth:`.PartLayout.plan`), every tensor of a chunk in one pass of tensor operations (scale, dither and
fingerprint weight per position, :class:`.Frame`), so the number of operations does not grow with the number of tensors;
the fingerprints stay on the device until the one allreduce, and the host reads the agreed wrap flags
once. Results are bit for bit those of a tensor-by-tensor loop (same float32 operations per coordinate).

Memory beyond the model: no model-sized buffer per neighbour. Persistent: the send message and the
receive rows (in-degree x message bytes). Transient per step: the mixing increment, dither, fingerprint
weights (int32) and scaled own values of the coordinates sent (d / P x 16 bytes), chunk-sized
temporaries, and a d-sized temporary for the local step whose per-tensor norms theta needs.

Traffic per step: ``4 T + sum_l ceil(ceil(n_l / P) b / 8)`` bytes (rounded up to a multiple of 4) to each
out-neighbour in one neighbour collective, plus an allreduce(max) of 2 T float32 (T tensors; booked by the
Ledger as 2 (n - 1) / n x 8 T bytes; 3 T float32 under ``theta="observed"``, whose distances ride on it);
the first step of an adaptive or observed theta adds one allreduce of T float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Any, Union

import torch

from ..codecs import lattice
from ..codecs._layout import chunk_elems
from ..codecs._rng import SeededGenerator
from .base import Algorithm, AlgorithmConfig, check_range, clone_optimizer_state
from .dpsgd import gossip_average
from .moniqua_frame import Frame, message_noise, per_run
from .moniqua_guard import LOW31, GuardRecord, ThetaBoundError, resync_parts
from .moniqua_parts import PartLayout, local_step_sizes, tensor_inf
from .moniqua_theta import THETA_RULES, TensorTheta, mixing_time
from .registry import register

__all__ = ["GUARDS", "IDENTITY_BITS", "ModuloGossip", "Moniqua", "MoniquaConfig", "ThetaBoundError", "default_gamma"]

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
    theta: a number > 0 (fixed), "adaptive" (the bound rule) or "observed" (from the recovered distances,
    see :mod:`.moniqua_theta`). theta_per: "tensor" or "model" (one theta, the paper's).
    theta_c: C of the adaptive rule. theta_decay: per-step decay of its running step bound, in [0, 1].
    theta_shrink: the guard scale's factor on a clean step, in (0, 1]. theta_cap: the most the guard
    may enlarge theta, >= 1. guard: "skip", "resync" or "raise".
    """

    bits: int = 4
    parts: int = 4
    rounding: str = "dither"
    gamma: Union[float, None] = None
    theta: Union[float, str] = "adaptive"
    theta_per: str = "tensor"
    theta_c: float = 1.0
    theta_decay: float = 0.99
    theta_shrink: float = 0.9
    theta_cap: float = 16.0
    guard: str = "skip"

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.bits, bool) or self.bits not in (*MODULO_BITS, IDENTITY_BITS):
            raise ValueError(f"bits must be one of 1, 2, 4, 8 (modulo codec) or 32 (identity), got {self.bits!r}")
        if isinstance(self.parts, bool) or not isinstance(self.parts, int) or self.parts < 1:
            raise ValueError(f"parts must be an int >= 1, got {self.parts!r}")
        if self.bits == IDENTITY_BITS and self.parts != 1:
            raise ValueError(f"parts must be 1 with bits=32 (the identity sends the whole model), got {self.parts}")
        if self.rounding not in lattice.ROUNDINGS:
            raise ValueError(f"rounding must be one of {lattice.ROUNDINGS}, got {self.rounding!r}")
        if self.rounding == "stochastic" and self.bits == 1:
            raise ValueError("rounding='stochastic' needs bits >= 2 (at 1 bit B_theta is infinite); "
                             "rounding='dither' gives a zero-mean error without a dead zone at 1 bit")
        if self.gamma is None:
            object.__setattr__(self, "gamma", default_gamma(self.bits))
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


class ModuloGossip:
    """Moniqua's mixing ``x[S] += gamma sum_j W_ij (x̂_j - x̂_i)`` on one rank, with theta per tensor and guard."""

    def __init__(self, comm, config: MoniquaConfig, flat):
        self.comm, self.config, self.gamma = comm, config, config.gamma
        self.identity = config.bits == IDENTITY_BITS
        self.record = GuardRecord([layer.name for layer in flat.layers])
        if self.identity:
            return
        self.layout = PartLayout(flat.layers, config.parts, config.bits)
        self.delta = lattice.delta(config.bits, config.rounding)
        self.rule = TensorTheta(self.layout.count, config, config.parts * mixing_time(comm.schedule, config.gamma))
        self.send = torch.zeros(self.layout.message_bytes, dtype=torch.uint8, device=flat.data.device)
        self.noise = SeededGenerator(config.seed + comm.rank) if config.rounding == "stochastic" else None
        self.dithered = config.rounding == "dither"
        self.chunk = chunk_elems(flat.data.device)

    def step_sizes(self, grad: torch.Tensor, lr: float, optimizer=None) -> torch.Tensor:
        """``||lr (mu buf + grad)_l||_inf`` per tensor: the local step about to be taken (theta's statistic)."""
        if self.identity:
            return torch.zeros(0)
        return local_step_sizes(grad, lr, optimizer, self.layout.sizes)

    def mix(self, x: torch.Tensor, step: int, step_inf: torch.Tensor) -> bool:
        """One mixing round over ``comm.topology(step)`` on ``x`` (in place); True if some part wrapped."""
        topo, rank = self.comm.topology(step), self.comm.rank
        self.record.steps += 1
        if self.identity:
            rows = self.comm.neighbor_allgather(x, step=step)
            _gossip(x, rows, topo.self_weight(rank), topo.neighbor_weights(rank), self.gamma)
            return False
        statistic = self.rule.statistic(step_inf, tensor_inf(x, self.layout.sizes))
        if not self.rule.ready():
            self.rule.observe(self._agree(statistic))
        theta = self.rule.theta()
        self.last_theta = theta
        scales = (1 << self.config.bits) * (1.0 - 2.0 * self.delta) / (2.0 * theta)
        frames, increment = self._encode(x, step, scales, math.fsum(topo.neighbor_weights(rank)))
        rows = self.comm.neighbor_allgather(self.send, step=step)
        local = self._decode(step, frames, scales, rows, increment)
        count = self.layout.count
        agreed = self._agree(torch.cat([local[:count], statistic, local[count:]]))
        wrapped = agreed[:count] > 0
        self.rule.observe(agreed[count:2 * count])
        if self.rule.observed:
            self.rule.observe_distance(agreed[2 * count:], wrapped)
        flags = wrapped.tolist()
        if any(flags) and self.config.guard == "raise":
            raise ThetaBoundError(self.record.describe(step, wrapped) + "; raise theta or theta_c, or use guard='skip'")
        for flag, (start, stop), position in zip(flags, self.layout.parts_at(step), self.layout.positions):
            if not flag:
                x[start:stop].add_(increment[position:position + stop - start], alpha=self.gamma)
        if any(flags):
            self.record.add(wrapped)
            if self.config.guard == "resync":
                resync_parts(self.comm, x, step, [self.layout.part(t, step) for t, w in enumerate(flags) if w])
                self.record.resyncs += 1
        self.rule.guard(wrapped)
        return any(flags)

    # ------------------------------------------------------------------ the two passes
    def _encode(self, x, step, scales, wsum) -> tuple[list[Frame], torch.Tensor]:
        """Pack this rank's codes and fingerprints into ``send``; return the frames and ``-wsum x̂_i``.

        Works chunk by chunk on the message body's code positions (:meth:`PartLayout.plan`), every tensor
        of a chunk in one pass: ``x`` gathered part by part (0 in the gaps), ``t = x s + u`` with s and
        u per coordinate, ``L = round(t)`` (stochastic: ``floor(x s + xi)``). The increment is indexed by
        code position.
        """
        bits, dev = self.config.bits, x.device
        scale, inverse = per_run(scales, dev), per_run(1.0 / scales, dev)
        key = lattice.stream_key(self.config.seed, step) if self.dithered else None
        body = self.send[self.layout.header_bytes:]
        increment = torch.empty(self.layout.codes, dtype=torch.float32, device=dev)
        noise = None if self.noise is None else message_noise(self.layout, step, self.chunk, self.noise, dev)
        frames, own = [], torch.zeros(self.layout.count + 1, dtype=torch.int64, device=dev)
        for chunk in self.layout.plan(step, self.chunk):
            frame = Frame(chunk, dev, key)  # frame.base: the receivers' t, with their own x, for every decode
            frame.encode(x, scale, inverse, noise, bits, body, own, -wsum, increment[chunk.lo:chunk.hi])
            frames.append(frame)
        self.layout.header(self.send).copy_(own[:-1].bitwise_and_(LOW31))
        return frames, increment

    def _decode(self, step, frames, scales, rows, increment) -> torch.Tensor:
        """Add ``sum_j W_ij x̂_j`` to ``increment``; return the number of mismatched edges per tensor (float32),
        followed, under ``theta="observed"``, by the largest ``|x̂_j - x_i|`` per tensor over the rows."""
        bits = self.config.bits
        weights = self.comm.topology(step).neighbor_weights(self.comm.rank)
        body, count = self.layout.header_bytes, self.layout.count
        fingerprints = torch.zeros(len(rows), count + 1, dtype=torch.int64, device=increment.device)
        inverse = per_run(1.0 / scales, increment.device)
        distance = torch.zeros(count + 1, dtype=torch.float32, device=increment.device) if self.rule.observed else None
        for frame in frames:
            lo, hi = frame.chunk.lo, frame.chunk.hi
            for k, (w, row) in enumerate(zip(weights, rows)):
                frame.recover_into(row[body:], bits, inverse, w, fingerprints[k], distance, increment[lo:hi])
        headers = rows[:, :body].view(torch.int32)
        mismatched = fingerprints[:, :count].bitwise_and_(LOW31).ne_(headers).sum(0).to(torch.float32)
        if distance is not None:
            mismatched = torch.cat([mismatched, distance[:count] / scales.to(distance)])
        return mismatched.cpu()

    def _agree(self, values: torch.Tensor) -> torch.Tensor:
        return self.comm.allreduce(values.to(torch.float32).clone(), "max").double()

    def close(self) -> None:
        """Rank 0 logs one summary of the guard's wrapped parts (see :class:`GuardRecord`)."""
        self.record.summarise(self.comm.rank, self.config.guard)

    # ------------------------------------------------------------------ stats and state
    def metrics(self) -> dict[str, Any]:
        """For ``metrics.jsonl``: the largest theta and the wrapped parts per tensor group, and their total."""
        if self.identity or not hasattr(self, "last_theta"):
            return {}
        return self.record.metrics(self.last_theta)

    def stats(self) -> dict[str, Any]:
        """gamma, theta's range and the guard's counters."""
        out = {"gamma": self.gamma, "wrapped_parts": self.record.total(), "resyncs": self.record.resyncs}
        if not self.identity and hasattr(self, "last_theta"):
            out.update(theta_min=float(self.last_theta.min()), theta_max=float(self.last_theta.max()),
                       theta_scale_max=float(self.rule.scale.max()))
            if self.rule.distance is not None:
                out["theta_distance_max"] = float(self.rule.distance.max())
        return out

    def state_dict(self) -> dict[str, Any]:
        """Counters, the theta rule and the stochastic-rounding generator (the dither is keyed by the step)."""
        out: dict[str, Any] = {"record": self.record.state_dict()}
        if not self.identity:
            out["rule"] = self.rule.state_dict()
            if self.noise is not None:
                out["noise"] = self.noise.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.record.load_state_dict(state["record"])
        if not self.identity:
            self.rule.load_state_dict(state["rule"])
            if self.noise is not None:
                self.noise.load_state_dict(state["noise"])


def _gossip(x, rows, self_weight, weights, gamma) -> None:
    """``x <- x + gamma sum_j W_ij (x_j - x)``; at gamma = 1 exactly D-PSGD's ``gossip_average``."""
    if gamma != 1.0:
        self_weight = 1.0 - gamma * (1.0 - self_weight)
        weights = [gamma * w for w in weights]
    gossip_average(x, rows, self_weight, weights)


@register
class Moniqua(Algorithm):
    """Moniqua on D-PSGD: modulo-quantized neighbour averaging with step gamma, then a local SGD step."""

    name = "moniqua"
    config_class = MoniquaConfig
    takes_optimizer = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        self.optimizer = self._local_sgd()
        self.gossip = ModuloGossip(comm, self.config, self.flat)

    def _step(self, grad: torch.Tensor) -> None:
        self._decayed(grad)
        update = self._user_update()
        sizes = (self.gossip.step_sizes(grad, self.lr, self.optimizer) if update is None
                 else self.gossip.step_sizes(update, 1.0))
        self.gossip.mix(self.flat.data, self.step_count, sizes)
        self._apply_update(update)

    def stats(self) -> dict[str, Any]:
        """Base stats plus theta's range, gamma and the guard's counters."""
        return {**super().stats(), **self.gossip.stats()}

    def metrics(self) -> dict[str, Any]:
        """theta and wrapped parts per tensor group (see :meth:`ModuloGossip.metrics`)."""
        return self.gossip.metrics()

    def close(self) -> None:
        """Summarise the guard once (rank 0), then close."""
        self.gossip.close()
        super().close()

    def _extra_state(self):
        return {"optimizer": clone_optimizer_state(self.optimizer), "gossip": self.gossip.state_dict()}

    def _load_extra_state(self, extra):
        self.optimizer.load_state_dict(extra["optimizer"])
        self.gossip.load_state_dict(extra["gossip"])
