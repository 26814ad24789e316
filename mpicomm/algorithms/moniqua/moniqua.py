"""Moniqua on D-PSGD: modulo-quantized gossip, then a local SGD step.

Lu, De Sa. "Moniqua: Modulo Quantized Communication in Decentralized SGD." ICML 2020.

Step k on rank i (W the mixing matrix of ``comm.topology(k)``, S_l the part of tensor l sent at step k,
x̂ recovered by :class:`~mpicomm.codecs.moniqua.MoniquaCodec` on the grid of theta_l)::

    x_i[S_l] += gamma sum_j W_ij (x̂_j - x̂_i)      for every tensor whose recovery did not wrap anywhere
    x_i <- x_i - alpha (mu buf + g)                 torch SGD step

With a user optimizer the last line is its update at the iterate before mixing, ``d_i = opt.step(x_i,
g_i) - x_i``, and theta's statistic is ``||d_i||_inf`` per tensor. Defaults: 4 bits on a rotating quarter
of each tensor (about 1 bit per parameter per step), gamma = 1, theta per tensor from the observed
distances, dither, guard "skip". The paper's form is ``bits=1, parts=1, theta_per="model", theta="adaptive",
rounding="nearest", gamma=0.5``;
``bits=32, parts=1, gamma=1`` is ``dpsgd`` bit for bit.

``overlap=True`` encodes and posts the message of step k in ``begin_step()``, before the forward pass:
theta_k is computed from what steps before k agreed, so the message depends on x(k) alone. The agreement
of step k (wrapped parts, theta's inputs: one small allreduce that needs the received codes) is posted at
the end of step k and settled at step k + 1, after its forward and backward pass (:mod:`.deferred`): theta
is one step older than the blocking step's, and a part that wrapped on another rank's edge is un-mixed one
step later. With a fixed theta and nothing wrapped the result is the blocking step's bit for bit. The
first step under theta="adaptive" or "observed" exchanges blocking (theta needs that step's gradient).
Convergence with rotating parts, the guard, the
work, memory and traffic per step: ``docs/algorithms/moniqua.md``.
"""

from __future__ import annotations

from typing import Any

import torch

from ...checkpoint.resize_rules import rebuilt_for_new_graph
from ..base import Algorithm, clone_optimizer_state
from ..shared.hierarchy import node_gossip_for
from .config import MoniquaDPSGDConfig
from .gossip import ModuloGossip
from .node import NodeModuloGossip

__all__ = ["Moniqua"]


class Moniqua(Algorithm):
    """Moniqua on D-PSGD: modulo-quantized neighbour averaging with step gamma, then a local SGD step."""

    name = "moniqua"
    config_class = MoniquaDPSGDConfig
    takes_optimizer = True
    resize_family = "decentralized"
    resize_sharded = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        self.optimizer = self._local_sgd()
        node_gossip = node_gossip_for(self.config, comm, self.flat.numel, self.flat.data)
        self.node_modulo = None if node_gossip is None else NodeModuloGossip(node_gossip, self.config, self.flat)
        self.node_gossip = node_gossip
        self.gossip = ModuloGossip(comm, self.config, self.flat) if node_gossip is None else self.node_modulo.gossip

    def _begin_exchange(self):
        return self.gossip.begin(self.flat.data, self.step_count) if self.config.overlap else None

    def _step(self, grad: torch.Tensor) -> None:
        self._decayed(grad)
        update = self._user_update()
        if self.node_modulo is not None:
            sizes = (self.node_modulo.step_sizes(grad, self.lr, self.optimizer) if update is None
                     else self.node_modulo.step_sizes(update, 1.0))
            self.node_modulo.mix(self.flat.data, self.step_count, sizes)
            self._apply_update(update)
            return
        sizes = (self.gossip.step_sizes(grad, self.lr, self.optimizer) if update is None
                 else self.gossip.step_sizes(update, 1.0))
        self.gossip.mix(self.flat.data, self.step_count, sizes, self._take_pending())
        self._apply_update(update)

    def stats(self) -> dict[str, Any]:
        """Base stats plus theta's range, gamma and the guard's counters."""
        return {**super().stats(), **self.gossip.stats()}

    def metrics(self) -> dict[str, Any]:
        """theta and wrapped parts per tensor group (see :meth:`ModuloGossip.metrics`)."""
        return self.gossip.metrics()

    def close(self) -> None:
        """Settle a pending agreement (``overlap``; a wrapped part is left unmixed, not resynced), summarise the
        guard once (rank 0), then close."""
        if self.node_modulo is None:
            self.gossip.settle(self.flat.data, resync=False)
        self.gossip.close()
        super().close()

    def _resize_rules(self):
        """A pending agreement (``overlap``) belongs to the old graph: the new one starts with none."""
        rules = super()._resize_rules()
        return {**rules, "extra.gossip.deferred": rebuilt_for_new_graph} if self.gossip.deferred is not None else rules

    def _extra_state(self):
        return {"optimizer": clone_optimizer_state(self.optimizer), "gossip": self.gossip.state_dict()}

    def _load_extra_state(self, extra):
        self.optimizer.load_state_dict(extra["optimizer"])
        self.gossip.load_state_dict(extra["gossip"])
