"""DCD-PSGD: decentralized SGD that sends compressed model differences.

Tang, Gan, Zhang, Zhang, Liu. "Communication Compression for Decentralized Training." NeurIPS 2018.

Step t on rank i (W the mixing matrix of ``comm.topology(t)``; x̂_j the replica of in-neighbour j,
which equals j's model exactly; g_i taken at x_i^t, plus weight_decay * x_i^t; momentum as torch SGD)::

    x_i^{t+1/2} = W_ii x_i^t + sum_{j != i} W_ij x̂_j - alpha g_i      (own replica = own model)
    z_i = x_i^{t+1/2} - x_i^t;   q_i = C(z_i);   x_i^{t+1} = x_i^t + q_i
    send q_i;   x̂_j <- x̂_j + q_j for every in-neighbour j

The message of step t is sent over the topology of step t + 1. Only x̂_i and the mix s_i are stored
(:mod:`~mpicomm.algorithms.shared.public_sum`), per distinct topology. Traffic: ``codec.payload_bytes(d)``
to each out-neighbour per step. DCD(identity) is ``dpsgd`` bit for bit. Time-varying schedules and the
replicas' start: ``docs/algorithms/decentralized.md``.

No overlap of the exchange with the forward and backward pass (no ``overlap`` option): the message of
step t is q_i = C(x_i^{t+1/2} - x_i^t), which holds -alpha g_i, so it cannot leave before the backward
pass of step t; and step t + 1 mixes with the replicas it updates, so it must arrive before then.
(Posting it at the end of step t and completing it in step t + 1 would overlap it with step t + 1's
compute, but leaves a message in flight between steps, where checkpoints are written.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Algorithm, clone_optimizer_state
from ..shared.codec_options import CodecConfig, make_rank_codec
from ..shared.gossip import gossip_average
from ..shared.public_sum import SumGossip

__all__ = ["DCD", "DCDConfig"]


@dataclass(frozen=True)
class DCDConfig(CodecConfig):
    """DCD-PSGD options: codec and codec_options (see :mod:`.replicas`), plus the common ones."""


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
