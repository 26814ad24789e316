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

Only x̂_i^T and s_i^T = W_ii x̂_i^T + sum_{j != i} W_ij x̂_j^T are stored (:mod:`.public_sum`);
receiving q_j adds W_ij q_j to s_i^T. Since x_i^t is x̂_i^T for T the topology of step t (the last line
above), the mix is s_i^T + W_ii (x_i^t - x̂_i^T), which is s_i^T itself unless x was changed between steps.

Memory beyond the model and the optimizer: 2 model copies (x̂_i, s_i) per distinct topology of the
schedule, whatever the degree, plus one d-element scratch vector; received payloads are compressed.

With a user optimizer (``optimizer=opt``) ``-alpha g_i`` is replaced by its update at x_i^t,
``d_i = opt.step(x_i^t, g_i) - x_i^t`` (the optimizer's groups carry lr, momentum and weight decay).

Traffic: ``codec.payload_bytes(d)`` to each out-neighbour of ``comm.topology(t + 1)`` per step.

Exact reduction: with the lossless ``identity`` codec the public copies would be the models, so the step
sends the model at step t over ``comm.topology(t)``, mixes it with D-PSGD's ``gossip_average`` and
takes the torch SGD step: DCD(identity) is the registered ``dpsgd`` bit for bit (same bytes too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Algorithm, clone_optimizer_state
from .dpsgd import gossip_average
from .public_sum import SumGossip
from .registry import register
from .replicas import CodecConfig, make_rank_codec

__all__ = ["DCD", "DCDConfig"]


@dataclass(frozen=True)
class DCDConfig(CodecConfig):
    """DCD-PSGD options: codec and codec_options (see :mod:`.replicas`), plus the common ones."""


@register
class DCD(Algorithm):
    """DCD-PSGD: mix exact neighbour models (kept as one weighted sum), step, send the compressed difference."""

    name = "dcd"
    config_class = DCDConfig
    takes_optimizer = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        self.optimizer = self._local_sgd()
        codec = make_rank_codec(self.config, comm.rank)
        self.gossip = SumGossip(comm, codec, self.flat.data, "model" if self.config.broadcast_init else "exchange")

    def _step(self, grad: torch.Tensor) -> None:
        self._decayed(grad)
        update = self._user_update()
        x, t, rank = self.flat.data, self.step_count, self.comm.rank
        topo = self.comm.topology(t)
        if self.gossip.lossless:
            gossip_average(x, self.gossip.models(x, t), topo.self_weight(rank), topo.neighbor_weights(rank))
        else:
            own, total = self.gossip.pair_at(t)
            x.sub_(own).mul_(topo.self_weight(rank)).add_(total)
        self._apply_update(update)
        if not self.gossip.lossless:
            self.gossip.advance(x, t + 1)
            x.copy_(self.gossip.pair_at(t + 1)[0])

    def _extra_state(self):
        return {"optimizer": clone_optimizer_state(self.optimizer), "gossip": self.gossip.state_dict()}

    def _load_extra_state(self, extra):
        self.optimizer.load_state_dict(extra["optimizer"])
        self.gossip.load_state_dict(extra["gossip"])
