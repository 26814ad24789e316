"""AD-PSGD and Moniqua-AD-PSGD: asynchronous decentralized SGD by one-sided pairwise averaging.

Lian, Zhang, Zhang, Liu. "Asynchronous Decentralized Parallel Stochastic Gradient Descent." ICML 2018.
Lu, De Sa. "Moniqua: Modulo Quantized Communication in Decentralized SGD." ICML 2020 (Moniqua-AD-PSGD).

Every rank runs its own loop; there is no barrier and no rendezvous between steps. Step k of rank i
(g_i taken at x_i before this step, plus weight_decay * x_i; j drawn uniformly from i's neighbours in
the schedule by a generator seeded with seed + rank)::

    read j's latest published message          (:class:`~mpicomm.comm.rma.Mailbox`, one-sided)
    adpsgd:          x_i <- x_i + (gamma/2) (x_j - x_i)        gamma = 1 (default): (x_i + x_j) / 2
    moniqua_adpsgd:  x_i <- x_i + (gamma/2) (x̂_j - x̂_i)      both recovered on j's grid (B_j), from x_i
    x_i <- x_i - alpha g_i                                     (torch SGD step; momentum if set)

With a user optimizer (``optimizer=opt``) the SGD line adds ``d_i = opt.step(x_i, g_i) - x_i``, its
update taken at x_i before the average (Moniqua's theta statistic is then ``||d_i||_inf``).
    publish x_i                                (adpsgd: fp32; moniqua_adpsgd: 16-byte header + payload)

What this implementation guarantees, and what it does not:

* Progress independence, no deadlock. On one node the mailbox is shared memory with a seqlock: reads
  and writes are plain copies that never wait for another rank (a read retries only while the owner is
  copying). Across nodes it is an RMA window: a step holds at most one lock at a time (shared on the
  peer for one Get, exclusive on itself for a local copy), so no lock cycle can form, and a read waits
  for the owner's copy, not its computation -- provided MPI progresses passive-target RMA by itself
  (MPICH: ``MPIR_CVAR_ASYNC_PROGRESS=1``; a warning is logged if that looks missing).
* Pull averaging: only the reading rank moves (the paper's pair update, executed by each side when it is
  the one that picks). x_j is j's model as of the end of its last step (stale by at most one of its
  steps). With the identity codec every averaging is a convex combination, so averaging alone never
  widens the spread of the models.
* The average is not preserved event by event. On a regular graph with uniform peer choice, the
  averaging preserves in expectation the weighted mean sum_i x_i / r_i (r_i = rank i's step rate), and
  rank i's gradient steps (r_i per unit time) move it by r_i / r_i: to first order the consensus follows
  the *unweighted* sum of the local gradients even when the ranks run at different speeds.
* Moniqua-AD-PSGD: B travels in the header (fingerprint int64, then B float64), so each rank runs its own
  theta: fixed, or adaptive from its *own* step statistic (no agreement is possible without a
  collective), with t_mix of the expected pull-averaging matrix -- and never below the largest theta it
  has seen in its peers' headers (a running max, decaying by ``theta_decay`` per read). That max-gossip
  is the asynchronous stand-in for the synchronous allreduce(max): when a rank's guard enlarges its
  theta, the ranks that read it follow, so the pair's messages become decodable both ways. A message
  with B = 0 means "nothing published yet" (before a rank's first step, when all ranks still hold the
  broadcast model); no average is taken with it. The fingerprint is checked *before* the average is
  applied: on a wrap, ``guard="raise"`` raises :class:`~mpicomm.algorithms.moniqua.ThetaBoundError`
  on the detecting rank (under ``python -m mpi4py`` the job aborts); ``guard="resync"`` skips that average, doubles this
  rank's theta scale (up to ``theta_cap``; gamma divided likewise at 1-2 bits) and warns at the 1st,
  2nd, 4th, 8th, ... skip. A full-precision resync round would need a rendezvous, so there is none:
  without the max-gossip above, tens to a hundred averages per thousand steps were skipped next to a
  rank 20x slower; with it, none in the test job.

Memory: adpsgd holds its mailbox slot and one read buffer, both fp32 model-sized (AD-PSGD's own need).
Moniqua-AD-PSGD holds three message-sized buffers (16 + ceil(d b / 8) bytes: its slot, the read buffer
and a copy of its own last message) and no model-sized one. Traffic per step: one read of one message
(booked as ``rma_get``). ``close()`` is collective: call it on every rank after training.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..codecs import ModuloCodec
from ..codecs._layout import chunk_elems, chunk_ranges
from ..comm.rma import Mailbox, passive_progress_warning
from .base import Algorithm, AlgorithmConfig, check_range, clone_optimizer_state
from .dpsgd import gossip_average
from .moniqua_single import (
    HEADER_BYTES,
    IDENTITY_BITS,
    LatticeFingerprint,
    SingleThetaConfig,
    ThetaBoundError,
    ThetaRule,
    inf_norm,
    int64_bytes,
    keeps_error,
    local_step_inf,
    matrix_mixing_time,
    payload_slice,
    read_int64,
)
from .registry import register

__all__ = ["ADPSGD", "ADPSGDConfig", "MoniquaADPSGD", "MoniquaADPSGDConfig", "expected_pull_matrix"]

log = logging.getLogger(__name__)

ASYNC_HEADER_BYTES = HEADER_BYTES + 8  # fingerprint (int64), then the sender's B (float64)


@dataclass(frozen=True)
class ADPSGDConfig(AlgorithmConfig):
    """AD-PSGD options.

    gamma: in (0, 1], scales the pair average (1: x_i <- (x_i + x_j) / 2).
    """

    gamma: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        check_range("gamma", self.gamma, lo=0.0, hi=1.0, lo_open=True)


@dataclass(frozen=True)
class MoniquaADPSGDConfig(SingleThetaConfig):
    """Moniqua-AD-PSGD options: Moniqua's (bits, rounding, gamma, theta, theta_c, guard, ...)."""


def expected_pull_matrix(schedule, gamma: float) -> np.ndarray:
    """E[W] of one pull-averaging event per rank: (1 - gamma/2) I + (gamma/2) P, P uniform over the neighbours."""
    n = schedule.size
    M = np.eye(n)
    for i in range(n):
        peers = schedule.union_in_neighbors(i)
        if peers:
            M[i, i] = 1.0 - gamma / 2.0
            M[i, list(peers)] += gamma / 2.0 / len(peers)
    return M


@register
class ADPSGD(Algorithm):
    """AD-PSGD: average with one random neighbour's last published model (one-sided read), then a local SGD step."""

    name = "adpsgd"
    config_class = ADPSGDConfig
    takes_optimizer = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        self.optimizer = self._local_sgd()
        self.gamma = self.config.gamma
        self.peers = comm.schedule.union_in_neighbors(comm.rank)
        self.peer_rng = torch.Generator().manual_seed(self.config.seed + comm.rank)
        self._setup_messages()
        self.mailbox = Mailbox(comm, self.message_bytes)
        self._publish()
        comm.barrier()  # every slot holds a model before anyone reads
        warning = passive_progress_warning() if self.mailbox.transport == "rma" else None
        if warning and comm.size > 1:
            log.warning("%s: %s", self.name, warning)

    # ------------------------------------------------------------------ message format (overridden by Moniqua)
    def _setup_messages(self) -> None:
        """The fp32 model is the message; one model-sized read buffer."""
        self.message_bytes = 4 * self.flat.numel
        self.peer_model = torch.empty_like(self.flat.data)

    def _publish(self) -> None:
        self.mailbox.publish(self.flat.data)

    def _average_with(self, peer: int) -> None:
        self.mailbox.read(peer, self.peer_model)
        gossip_average(self.flat.data, self.peer_model.unsqueeze(0), 1.0 - self.gamma / 2.0, (self.gamma / 2.0,))

    # ------------------------------------------------------------------ the step
    def next_peer(self) -> int:
        """Draw the neighbour to average with (advances the seeded peer generator)."""
        return self.peers[int(torch.randint(len(self.peers), (1,), generator=self.peer_rng))]

    def _step(self, grad: torch.Tensor) -> None:
        self._decayed(grad)
        update = self._user_update()
        self._observe(grad, update)
        if self.peers:
            self._average_with(self.next_peer())
        self._apply_update(update)
        self._publish()

    def _observe(self, grad: torch.Tensor, update: torch.Tensor | None) -> None:
        """Hook for per-step statistics (Moniqua's theta): the gradient, and a user optimizer's update (or None)."""

    def close(self) -> None:
        """Collective: free the window (after every rank has finished training)."""
        self.mailbox.close()

    # ------------------------------------------------------------------ state
    def _extra_state(self):
        return {"optimizer": clone_optimizer_state(self.optimizer), "peer_rng": self.peer_rng.get_state(),
                "gamma": self.gamma}

    def _load_extra_state(self, extra):
        self.optimizer.load_state_dict(extra["optimizer"])
        self.peer_rng.set_state(extra["peer_rng"])
        self.gamma = float(extra["gamma"])
        self._restore_message(extra)

    def _restore_message(self, extra) -> None:
        """Publish the loaded model (the slot must show what this rank holds)."""
        self._publish()


@register
class MoniquaADPSGD(ADPSGD):
    """Moniqua-AD-PSGD: the pair average of AD-PSGD on modulo-quantized models (b bits per coordinate)."""

    name = "moniqua_adpsgd"
    config_class = MoniquaADPSGDConfig

    def _setup_messages(self) -> None:
        config = self.config
        if config.bits == IDENTITY_BITS:
            super()._setup_messages()
            self.codec = None
            return
        device = self.flat.data.device
        self.codec = ModuloCodec(config.bits, config.rounding, seed=config.seed + self.comm.rank)
        self.chunk = chunk_elems(device)
        self.fingerprint = LatticeFingerprint(self.codec, self.chunk)
        t_mix = matrix_mixing_time([expected_pull_matrix(self.comm.schedule, config.gamma)])
        self.rule = ThetaRule(config, t_mix)
        self.message_bytes = ASYNC_HEADER_BYTES + self.codec.payload_bytes(self.flat.numel)
        self.own = torch.zeros(self.message_bytes, dtype=torch.uint8, device=device)
        self.peer_message = torch.empty_like(self.own)
        self.skipped = 0
        self.peer_theta = 0.0  # running max (decay theta_decay per read) of the thetas seen in peers' headers
        self.last: dict[str, float] = {}

    def _observe(self, grad, update):
        if self.codec is not None:
            step_inf = local_step_inf(grad, self.lr, self.optimizer) if update is None else inf_norm(update)
            self.rule.observe(step_inf, inf_norm(self.flat.data))

    def _publish(self) -> None:
        if self.codec is None:
            return super()._publish()
        x = self.flat.data
        if not self.rule.ready():  # before the first step: B = 0 tells readers there is nothing to average yet
            self.own.zero_()
            self.mailbox.publish(self.own)
            return
        B = self.codec.b_theta(self.theta())
        payload = self.codec.encode(x, B)
        self.own[:HEADER_BYTES].copy_(int64_bytes(self.fingerprint.of(payload, x, B)[0]))
        self.own[HEADER_BYTES:ASYNC_HEADER_BYTES].copy_(torch.tensor([B], dtype=torch.float64).view(torch.uint8))
        self.own[ASYNC_HEADER_BYTES:].copy_(payload)
        self.mailbox.publish(self.own)

    def theta(self) -> float:
        """theta of this rank's next message: its own rule's, or a larger one seen in a peer's header."""
        return max(self.rule.theta(), self.peer_theta)

    def _average_with(self, peer: int) -> None:
        if self.codec is None:
            return super()._average_with(peer)
        x, message = self.flat.data, self.mailbox.read(peer, self.peer_message)
        B = float(message[HEADER_BYTES:ASYNC_HEADER_BYTES].clone().view(torch.float64)[0])
        own_B = float(self.own[HEADER_BYTES:ASYNC_HEADER_BYTES].clone().view(torch.float64)[0])
        if B == 0.0 or own_B == 0.0:  # a side has not finished a step yet: both still hold the initial model
            return
        theta_peer = B * (1.0 - 2.0 * self.codec.delta) / 2.0  # B = 2 theta / (1 - 2 delta)
        self.peer_theta = max(self.config.theta_decay * self.peer_theta, theta_peer)
        payload = message[ASYNC_HEADER_BYTES:]
        fingerprint, distance = self.fingerprint.of(payload, x, B)
        self.last = {"theta_own": self.theta(), "B_peer": B, "recovered_distance": distance}
        if fingerprint != read_int64(message):
            self._violation(peer, B, distance)
            return
        # x̂_i on the peer's grid, so that the two quantization errors cancel when the models agree
        own_payload = self.own[ASYNC_HEADER_BYTES:] if own_B == B else self.codec.encode(x, B)
        bits, half = self.codec.bits, self.gamma / 2.0
        for start, stop in chunk_ranges(x.numel(), self.chunk):
            xc = x[start:stop]
            mine = self.codec.decode(payload_slice(own_payload, bits, start, stop), xc, B)
            theirs = self.codec.decode(payload_slice(payload, bits, start, stop), xc, B)
            xc.add_(theirs.sub_(mine), alpha=half)

    def _violation(self, peer: int, B: float, distance: float) -> None:
        what = (f"moniqua_adpsgd rank {self.comm.rank} step {self.step_count}: the modulo recovery of rank "
                f"{peer}'s model wrapped (|x_i - x_j|_inf exceeded B/2 = {B / 2:.4g}; largest recovered "
                f"distance {distance:.4g})")
        if self.config.guard == "raise":
            raise ThetaBoundError(what)
        factor = self.rule.enlarge()
        if keeps_error(self.codec):
            self.gamma /= factor
        self.skipped += 1
        if self.skipped & (self.skipped - 1) == 0:  # warn at the 1st, 2nd, 4th, 8th, ... skipped average
            log.warning("%s; skipped this average (%d so far on this rank); theta scale -> %g, gamma -> %.4g",
                        what, self.skipped, self.rule.scale, self.gamma)

    def stats(self) -> dict[str, Any]:
        """Base stats plus this rank's theta, the last peer's B, gamma and skipped averages."""
        out = super().stats()
        if self.codec is not None:
            out.update(gamma=self.gamma, theta=self.theta(), theta_scale=self.rule.scale,
                       skipped=self.skipped, **self.last)
        return out

    def _extra_state(self):
        extra = super()._extra_state()
        if self.codec is not None:
            extra.update(rule=self.rule.state_dict(), codec=self.codec.state_dict(), skipped=self.skipped,
                         peer_theta=self.peer_theta,
                         message=self.own.clone())
        return extra

    def _load_extra_state(self, extra):
        if self.codec is not None:
            self.rule.load_state_dict(extra["rule"])
            self.codec.load_state_dict(extra["codec"])
            self.skipped, self.peer_theta = int(extra["skipped"]), float(extra["peer_theta"])
        super()._load_extra_state(extra)

    def _restore_message(self, extra) -> None:
        if self.codec is None:
            return super()._restore_message(extra)
        self.own.copy_(extra["message"])
        self.mailbox.publish(self.own)
