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
theta_k is computed from what steps before k agreed (theta's running bound folds in step k's statistic,
the local step's size, only after step k's message is encoded, for use from step k + 1), so the message
depends on x(k) alone and the result is bit for bit the blocking step's. The one exception is the first
step under theta="adaptive" or "observed": no statistic has been agreed yet, theta needs the gradient of
that step, and that step exchanges blocking (also bit for bit the same). The guard's agreement (wrapped
parts, theta's inputs) stays a blocking allreduce in ``step()``: it needs the received codes and the
gradient. Convergence with rotating parts, the guard, the
work, memory and traffic per step: ``docs/algorithms/moniqua.md``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..base import Algorithm, clone_optimizer_state
from ..shared.hierarchy import ShardOfFlat, node_gossip_for, shard_layers
from .config import MoniquaDPSGDConfig
from .gossip import ModuloGossip
from .theta import local_step_sizes

__all__ = ["Moniqua"]


class Moniqua(Algorithm):
    """Moniqua on D-PSGD: modulo-quantized neighbour averaging with step gamma, then a local SGD step."""

    name = "moniqua"
    config_class = MoniquaDPSGDConfig
    takes_optimizer = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        self.optimizer = self._local_sgd()
        self.node_gossip = node_gossip_for(self.config, comm, self.flat.numel, self.flat.data)
        if self.node_gossip is None:
            self.gossip = ModuloGossip(comm, self.config, self.flat)
            return
        counts, local = self.node_gossip.levels.counts, self.node_gossip.levels.layout.local_rank
        shards = [shard_layers(self.flat.layers, sum(counts[:j]), sum(counts[:j + 1])) for j in range(len(counts))]
        self.part_sizes = [part.numel for parts in shards for part in parts]  # every shard's tensor parts, in order
        first = sum(len(parts) for parts in shards[:local])
        self.own_parts = slice(first, first + len(shards[local]))
        own = ShardOfFlat(self.node_gossip.shard_of(self.flat.data), shards[local])
        self.gossip = ModuloGossip(self.node_gossip.graph, self.config, own)

    def _begin_exchange(self):
        return self.gossip.begin(self.flat.data, self.step_count) if self.config.overlap else None

    def _step(self, grad: torch.Tensor) -> None:
        self._decayed(grad)
        update = self._user_update()
        if self.node_gossip is not None:
            sizes = self._node_step_sizes(grad, update)
            self.node_gossip.mix_with(self.flat.data, self.step_count,
                                      lambda shard, step: self.gossip.mix(shard, step, sizes))
            self._apply_update(update)
            return
        sizes = (self.gossip.step_sizes(grad, self.lr, self.optimizer) if update is None
                 else self.gossip.step_sizes(update, 1.0))
        self.gossip.mix(self.flat.data, self.step_count, sizes, self._take_pending())
        self._apply_update(update)

    def _node_step_sizes(self, grad: torch.Tensor, update: torch.Tensor | None) -> torch.Tensor:
        """Collective inside the node: the largest local step on the node per tensor part of this rank's shard."""
        sizes = (local_step_sizes(grad, self.lr, self.optimizer, self.part_sizes) if update is None
                 else local_step_sizes(update, 1.0, None, self.part_sizes))
        return self.node_gossip.levels.node.allreduce(sizes, "max")[self.own_parts]

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
