"""AD-PSGD and Moniqua-AD-PSGD: asynchronous decentralized SGD by one-sided pairwise averaging.

Lian, Zhang, Zhang, Liu. "Asynchronous Decentralized Parallel Stochastic Gradient Descent." ICML 2018.
Lu, De Sa. "Moniqua: Modulo Quantized Communication in Decentralized SGD." ICML 2020 (Moniqua-AD-PSGD).

Every rank runs its own loop; there is no barrier and no rendezvous between steps. Step k of rank i
(g_i taken at x_i before this step, plus weight_decay * x_i; j drawn uniformly from i's neighbours in
the schedule by a generator seeded with seed + rank; v the number of steps j had taken when it published)::

    read j's latest published message          (:class:`~mpicomm.comm.rma.Mailbox`, one-sided)
    adpsgd:          x_i <- x_i + (gamma/2) (x_j - x_i)        gamma = 1 (default): (x_i + x_j) / 2
    moniqua_adpsgd:  x_i[S_l] <- x_i[S_l] + (gamma/2) (x̂_j - x̂_i)[S_l]   for every tensor l that did not wrap
    x_i <- x_i - alpha g_i                                     (torch SGD step; momentum if set)
    publish x_i                                (adpsgd: fp32; moniqua_adpsgd: header + b-bit codes, v = k + 1)

With a user optimizer (``optimizer=opt``) the SGD line adds ``d_i = opt.step(x_i, g_i) - x_i``, its
update taken at x_i before the average (Moniqua's theta statistic is then ``||d_{i,l}||_inf`` per tensor).
For Moniqua-AD-PSGD, S_l is tensor l's part (v + l) mod P of j's message and x̂_j, x̂_i are recovered on
j's grid per tensor, s_l = 2^b (1 - 2 delta) / (2 theta_{j,l}) read from j's header, with the dither of
j's stream (seed, v): see :mod:`.moniqua_pull` for the message and the recovery.

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

Moniqua-AD-PSGD, adapted to asynchrony (the synchronous :mod:`.moniqua` agrees theta and the wrap flags
by an allreduce every step; here ranks are at different steps and nothing is agreed):

* theta per tensor (:class:`~.moniqua_theta.TensorTheta`) from this rank's *own* statistic (its local
  step per tensor, with the floor), with t = P t_mix of the expected pull-averaging matrix, and never
  below the largest theta seen in its peers' headers (a running max per tensor, decaying by
  ``theta_decay`` per read): the asynchronous stand-in for the allreduce(max), so that when a rank's
  guard enlarges a tensor's theta, the ranks that read it follow and the pair's messages become
  decodable both ways. ``theta_per="model"`` gives one theta (the paper's form).
* Every reader decodes on the *publisher's* grid with the publisher's dither key (seed, v) and part
  phase v, all in the header: the two ends of a pull agree on everything without a collective.
* Guard, check then mix: every tensor's part is decoded and fingerprinted before x_i is touched; only
  the tensors whose fingerprint matches are mixed. ``guard="skip"``: a wrapped tensor is left as it is in
  that pull (its scale doubles, up to ``theta_cap``; clean pulls shrink it by ``theta_shrink``);
  ``guard="raise"`` raises :class:`~.moniqua_guard.ThetaBoundError` on the reading rank, before anything
  moved (under ``python -m mpi4py`` the job aborts). ``"resync"`` is refused: a full-precision exchange
  needs the peer's participation. Wraps are counted per tensor group on each rank (``metrics.jsonl``);
  ``close()`` adds up every rank's and rank 0 logs one summary.
* What holds for the average: a pull moves only x_i, and a skipped tensor not at all (the mean over ranks
  of a wrapped tensor is unchanged by that pull). On a mixed part x̂_j - x̂_i = (L'_j - L_i) / s_l, both
  points on j's grid. With ``rounding="nearest"`` (the default here) that is a deterministic function of
  the pair, within 1/s_l of x_j - x_i, and 0 when both lie in one cell: ranks that agree feel no pull.
  With ``"dither"`` (the synchronous default) E_u[x̂_j - x̂_i] = x_j - x_i, AD-PSGD's own pull in
  expectation, but its zero-mean noise (up to half a grid step per coordinate and pull) is not cancelled
  by a symmetric update as in the synchronous mixing: it moves the ranks' mean, a random walk with no
  restoring force on coordinates whose gradient is 0. Measured on the digits MLP (bench/moniqua_adpsgd.py,
  4 ranks, 20 epochs, one run each): the dithered 4 bits on quarters ended at a consensus test loss of
  7.4-273 (93.3-95.8 %, four runs), nearest at 0.06-0.16 (97.2-98.3 %, five runs).
* A message with version -1 means "nothing published yet" (an adaptive theta before this rank's first
  step, when all ranks still hold the broadcast model); no average is taken with it.

Memory: adpsgd holds its mailbox slot and one read buffer, both fp32 model-sized (AD-PSGD's own need).
Moniqua-AD-PSGD holds three message-sized buffers (its slot, the read buffer and a copy of its own
message, 8 + 8 T + sum_l ceil(ceil(n_l / P) b / 8) bytes rounded up to 4), a transient d / P float32
increment per pull (with stochastic rounding also the xi of a message's code positions, d / P float32, per
encode and per pull), chunk-sized temporaries, and no model-sized buffer. Traffic per step: one read of one
message (booked as ``rma_get``). ``close()`` is collective: call it on every rank after training.

``bits=32`` (with ``parts=1``) publishes the fp32 model and runs AD-PSGD's own code: Moniqua-AD-PSGD
then equals ``adpsgd`` bit for bit (same gamma). Checkpoints hold the theta rule, the peers' theta max,
the guard record, the stochastic-rounding generator and the last published message (republished byte
for byte on load); a state round-trips exactly, but an asynchronous run continues from it only as
deterministically as the ranks' timing allows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..comm.rma import Mailbox, passive_progress_warning
from .base import Algorithm, AlgorithmConfig, check_range, clone_optimizer_state
from .dpsgd import gossip_average
from .moniqua import IDENTITY_BITS, MoniquaConfig
from .moniqua_guard import GuardRecord, ThetaBoundError
from .moniqua_parts import local_step_sizes, tensor_inf
from .moniqua_pull import PullMessage
from .moniqua_theta import TensorTheta, matrix_mixing_time
from .registry import register

__all__ = ["ADPSGD", "ADPSGDConfig", "MoniquaADPSGD", "MoniquaADPSGDConfig", "expected_pull_matrix"]

log = logging.getLogger(__name__)

ASYNC_GUARDS = ("skip", "raise")


@dataclass(frozen=True)
class ADPSGDConfig(AlgorithmConfig):
    """AD-PSGD options.

    gamma: in (0, 1], scales the pair average (1: x_i <- (x_i + x_j) / 2).
    """

    gamma: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        check_range("gamma", self.gamma, lo=0.0, hi=1.0, lo_open=True)


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
        self._publish(self.step_count)
        comm.barrier()  # every slot holds a model before anyone reads
        warning = passive_progress_warning() if self.mailbox.transport == "rma" else None
        if warning and comm.size > 1:
            log.warning("%s: %s", self.name, warning)

    # ------------------------------------------------------------------ message format (overridden by Moniqua)
    def _setup_messages(self) -> None:
        """The fp32 model is the message; one model-sized read buffer."""
        self.message_bytes = 4 * self.flat.numel
        self.peer_model = torch.empty_like(self.flat.data)

    def _publish(self, steps: int) -> None:
        """Publish this rank's model after its ``steps``-th step."""
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
        self._publish(self.step_count + 1)

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
        self._publish(self.step_count)




@dataclass(frozen=True)
class MoniquaADPSGDConfig(MoniquaConfig):
    """Moniqua-AD-PSGD options: those of Moniqua (bits, parts, gamma, theta, theta_per, theta_c, ...).

    rounding: "nearest" (default here), "dither" (shared subtractive: its zero-mean noise enters the ranks'
    mean, which a one-sided pull does not preserve) or "stochastic" (bits >= 2). guard: "skip" (a wrapped
    tensor is left unmixed in that pull) or "raise"; "resync" is refused: it needs a full-precision exchange
    with the peer, which a one-sided read does not have.
    """

    rounding: str = "nearest"

    def __post_init__(self):
        super().__post_init__()
        if self.theta == "observed":
            raise ValueError("theta='observed' is not available for moniqua_adpsgd: it agrees every rank's recovered "
                             "distances in a per-step collective, which one-sided reads do not have; use 'adaptive' "
                             "or a number")
        if self.guard not in ASYNC_GUARDS:
            raise ValueError(f"guard must be one of {ASYNC_GUARDS} for moniqua_adpsgd, got {self.guard!r} "
                             "(a resync needs a full-precision exchange with the peer; AD-PSGD's reads are one-sided)")


@register
class MoniquaADPSGD(ADPSGD):
    """Moniqua-AD-PSGD: AD-PSGD's pull average on modulo-quantized models, theta per tensor, check then mix."""

    name = "moniqua_adpsgd"
    config_class = MoniquaADPSGDConfig

    def _setup_messages(self) -> None:
        config, count = self.config, len(self.flat.layers)
        self.record = GuardRecord([layer.name for layer in self.flat.layers])
        if config.bits == IDENTITY_BITS:
            super()._setup_messages()
            self.codec = None
            return
        device = self.flat.data.device
        self.codec = PullMessage(self.flat.layers, config.bits, config.parts, config.rounding, config.seed,
                                 config.seed + self.comm.rank, device)
        t_mix = matrix_mixing_time([expected_pull_matrix(self.comm.schedule, config.gamma)])
        self.rule = TensorTheta(count, config, config.parts * t_mix)
        self.peer_theta = torch.zeros(count, dtype=torch.float64)  # running max (decay per read) of peers' thetas
        self.message_bytes = self.codec.nbytes
        self.own = torch.zeros(self.message_bytes, dtype=torch.uint8, device=device)
        self.peer_message = torch.empty_like(self.own)

    def _observe(self, grad, update):
        if self.codec is not None:
            sizes = self.codec.layout.sizes
            step = (local_step_sizes(grad, self.lr, self.optimizer, sizes) if update is None
                    else local_step_sizes(update, 1.0, None, sizes))
            self.rule.observe(self.rule.statistic(step, tensor_inf(self.flat.data, sizes)))

    def theta(self) -> torch.Tensor:
        """theta per tensor of this rank's next message: its own rule's, or a larger one seen in a peer's header."""
        return torch.maximum(self.rule.theta(), self.peer_theta)

    def _publish(self, steps: int) -> None:
        if self.codec is None:
            return super()._publish(steps)
        if self.rule.ready():
            self.codec.encode(self.flat.data, steps, self.theta(), self.own)
        else:  # an adaptive theta before the first step: readers see "nothing yet" (all still hold x_0)
            self.codec.empty(self.own)
        self.mailbox.publish(self.own)

    def _average_with(self, peer: int) -> None:
        if self.codec is None:
            return super()._average_with(peer)
        message = self.mailbox.read(peer, self.peer_message)
        version = self.codec.version(message)
        if version < 0:
            return
        self.peer_theta = torch.maximum(self.peer_theta * self.config.theta_decay,
                                        self.codec.thetas(self.codec.header_scales(message)))
        increment, wrapped = self.codec.pull(message, self.flat.data, version)  # check: x untouched so far
        self.record.steps += 1
        if wrapped.any():
            self.record.add(wrapped)
            if self.config.guard == "raise":
                raise ThetaBoundError(f"{self.record.describe(self.step_count, wrapped)} (rank {self.comm.rank} "
                                      f"pulling rank {peer}'s model of its step {version}); raise theta or "
                                      "theta_c, or use guard='skip'")
        self.codec.mix(self.flat.data, version, increment, wrapped, self.gamma / 2.0)  # then mix
        self.rule.guard(wrapped)

    def stats(self) -> dict[str, Any]:
        """Base stats plus gamma, theta's range and the guard's counters (this rank's pulls and wrapped parts)."""
        out = {**super().stats(), "gamma": self.gamma, "wrapped_parts": self.record.total(), "pulls": self.record.steps}
        if self.codec is not None and self.rule.ready():
            theta = self.theta()
            out.update(theta_min=float(theta.min()), theta_max=float(theta.max()),
                       theta_scale_max=float(self.rule.scale.max()))
        return out

    def metrics(self) -> dict[str, Any]:
        """For ``metrics.jsonl``: this rank's largest theta and wrapped parts per tensor group (see GuardRecord)."""
        if self.codec is None or not self.rule.ready():
            return {}
        return self.record.metrics(self.theta())

    def close(self) -> None:
        """Collective: rank 0 logs one summary of every rank's wrapped parts, then the window is freed."""
        self.record.summed(self.comm).summarise(self.comm.rank, "skip")
        super().close()

    def _extra_state(self):
        extra = {**super()._extra_state(), "record": self.record.state_dict()}
        if self.codec is not None:
            extra.update(rule=self.rule.state_dict(), peer_theta=self.peer_theta.clone(), message=self.own.clone())
            if self.codec.noise is not None:
                extra["noise"] = self.codec.noise.state_dict()
        return extra

    def _load_extra_state(self, extra):
        self.record.load_state_dict(extra["record"])
        if self.codec is not None:
            self.rule.load_state_dict(extra["rule"])
            self.peer_theta = extra["peer_theta"].clone().double()
            if self.codec.noise is not None:
                self.codec.noise.load_state_dict(extra["noise"])
        super()._load_extra_state(extra)

    def _restore_message(self, extra) -> None:
        """Publish the saved message byte for byte (re-encoding would draw stochastic rounding anew)."""
        if self.codec is None:
            return super()._restore_message(extra)
        self.own.copy_(extra["message"])
        self.mailbox.publish(self.own)
