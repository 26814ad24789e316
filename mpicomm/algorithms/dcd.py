"""DCD-PSGD: decentralized SGD that sends compressed model differences.

Tang, Gan, Zhang, Zhang, Liu. "Communication Compression for Decentralized Training." NeurIPS 2018.

Step t on rank i (W the mixing matrix of ``comm.topology(t)``; x̂_j the replica of in-neighbour j,
which equals j's model exactly; g_i taken at x_i^t, plus weight_decay * x_i^t; momentum as torch SGD)::

    x_i^{t+1/2} = W_ii x_i^t + sum_{j != i} W_ij x̂_j - alpha g_i      (own replica = own model)
    z_i = x_i^{t+1/2} - x_i^t;   q_i = C(z_i);   x_i^{t+1} = x_i^t + q_i
    send q_i;   x̂_j <- x̂_j + q_j for every in-neighbour j

The message of step t is sent over the topology of step t + 1, whose step mixes with it. On a
time-varying schedule the replicas are kept per distinct topology T (:mod:`.replicas`) and rank i's
public copy x̂_i^T takes the role of x_i^t above: z_i = x_i^{t+1/2} - x̂_i^T, x_i^{t+1} = x̂_i^T + q_i
for T the topology of step t + 1. So a receiver's replica is always the sender's current model and
step t + 1 mixes exact models; on a static topology x̂_i^T is x_i^t and this is the paper's update.
Replicas start at the common initial model (``broadcast_init=True``) or, without it, from one
full-precision exchange per distinct topology at construction.

With a user optimizer (``optimizer=opt``) ``-alpha g_i`` is replaced by its update at x_i^t,
``d_i = opt.step(x_i^t, g_i) - x_i^t`` (the optimizer's groups carry lr, momentum and weight decay).

Traffic: ``codec.payload_bytes(d)`` to each out-neighbour of ``comm.topology(t + 1)`` per step.

Exact reduction: with the lossless ``identity`` codec the replicas would be the models, so the step
sends the model at step t over ``comm.topology(t)``, mixes it with D-PSGD's ``gossip_average`` and
takes the torch SGD step: DCD(identity) is the registered ``dpsgd`` bit for bit (same bytes too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Algorithm, clone_optimizer_state
from .dpsgd import gossip_average
from .registry import register
from .replicas import CodecConfig, ReplicaGossip, make_rank_codec

__all__ = ["DCD", "DCDConfig"]


@dataclass(frozen=True)
class DCDConfig(CodecConfig):
    """DCD-PSGD options: codec and codec_options (see :mod:`.replicas`), plus the common ones."""


@register
class DCD(Algorithm):
    """DCD-PSGD: mix exact neighbour replicas, take an SGD step, send the compressed model difference."""

    name = "dcd"
    config_class = DCDConfig
    takes_optimizer = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        self.optimizer = self._local_sgd()
        codec = make_rank_codec(self.config, comm.rank)
        self.gossip = ReplicaGossip(comm, codec, self.flat.data, "model" if self.config.broadcast_init else "exchange")

    def _step(self, grad: torch.Tensor) -> None:
        self._decayed(grad)
        update = self._user_update()
        x, t, rank = self.flat.data, self.step_count, self.comm.rank
        topo = self.comm.topology(t)
        rows = self.gossip.models(x, t) if self.gossip.lossless else self.gossip.copies_at(t)[1:]
        gossip_average(x, rows, topo.self_weight(rank), topo.neighbor_weights(rank))
        self._apply_update(update)
        if not self.gossip.lossless:
            self.gossip.advance(x, t + 1)
            x.copy_(self.gossip.copies_at(t + 1)[0])

    def _extra_state(self):
        return {"optimizer": clone_optimizer_state(self.optimizer), "gossip": self.gossip.state_dict()}

    def _load_extra_state(self, extra):
        self.optimizer.load_state_dict(extra["optimizer"])
        self.gossip.load_state_dict(extra["gossip"])
