"""AD-PSGD: asynchronous decentralized SGD by one-sided pairwise averaging.

Lian, Zhang, Zhang, Liu. "Asynchronous Decentralized Parallel Stochastic Gradient Descent." ICML 2018.

Every rank runs its own loop, with no barrier between steps. Step k of rank i (g_i at x_i plus
weight_decay x_i; j drawn uniformly from i's neighbours by a generator seeded with seed + rank)::

    read j's latest published model x_j        (:class:`~mpicomm.comm.rma.Mailbox`, one-sided)
    x_i <- x_i + (gamma/2) (x_j - x_i)         gamma = 1 (default): (x_i + x_j) / 2
    x_i <- x_i - alpha g_i                     (torch SGD step; momentum if set)
    publish x_i

With a user optimizer the last SGD line adds its update ``d_i = opt.step(x_i, g_i) - x_i`` taken at x_i
before the average. Memory: the mailbox slot and one read buffer, both model-sized. ``close()`` is
collective. What is and is not guaranteed (progress, staleness, the average): ``docs/algorithms/adpsgd.md``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ...checkpoint.resize_rules import own_rank
from ...comm.rma import Mailbox, passive_progress_warning
from ..base import Algorithm, AlgorithmConfig, check_range, clone_optimizer_state
from ..shared.gossip import gossip_average

__all__ = ["ADPSGD", "ADPSGDConfig", "expected_pull_matrix"]

log = logging.getLogger(__name__)


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


class ADPSGD(Algorithm):
    """AD-PSGD: average with one random neighbour's last published model (one-sided read), then a local SGD step."""

    name = "adpsgd"
    asynchronous = True
    config_class = ADPSGDConfig
    takes_optimizer = True
    resize_family = "decentralized"

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
        """The model, in its dtype, is the message; one model-sized read buffer."""
        self.message_bytes = self.flat.data.element_size() * self.flat.numel
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

    def _resize_rules(self):
        """On a resize (a consensus restart) the generator that picks this rank's peers stays its own."""
        return {**super()._resize_rules(), "extra.peer_rng": own_rank}

    def _load_extra_state(self, extra):
        self.optimizer.load_state_dict(extra["optimizer"])
        self.peer_rng.set_state(extra["peer_rng"])
        self.gamma = float(extra["gamma"])
        self._restore_message(extra)

    def _restore_message(self, extra) -> None:
        """Publish the loaded model (the slot must show what this rank holds)."""
        self._publish(self.step_count)
