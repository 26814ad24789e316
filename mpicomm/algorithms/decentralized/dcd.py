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

``hierarchical`` (auto: on over several nodes of several ranks; :mod:`~mpicomm.algorithms.shared.hierarchy`):
the nodes are DCD's participants. Every rank of node a holds the node's model y_a (the ranks start from
their node's average); with u_i the local update of rank i (``-alpha g_i``, or the user optimizer's) and
W_nodes the graph of nodes (``node_topology``), on each local rank's shard::

    y_a^{t+1/2} = W_nodes[a, a] y_a + sum_{b != a} W_nodes[a, b] ŷ_b + (1/L) sum_{i on a} u_i
    q_a = C(y_a^{t+1/2} - y_a);   y_a^{t+1} = y_a + q_a;   send q_a to the neighbouring nodes

(the node's mean update by a reduce-scatter inside the node, the compressed difference of each shard
between the same local ranks of neighbouring nodes, y^{t+1} by an allgather inside the node). That is DCD
over the N nodes with the node's averaged stochastic gradient, so Tang et al.'s analysis holds with the
spectral gap of ``W_nodes`` and a gradient variance divided by L.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...checkpoint.resize_rules import public_copies
from ...codecs.base import check_float32
from ..base import Algorithm, clone_optimizer_state
from ..shared.codec_options import CodecConfig, make_rank_codec
from ..shared.gossip import gossip_average
from ..shared.hierarchy import NodeGraphConfig, node_gossip_for
from ..shared.public_sum import SumGossip

__all__ = ["DCD", "DCDConfig"]


@dataclass(frozen=True)
class DCDConfig(NodeGraphConfig, CodecConfig):
    """DCD-PSGD options: codec and codec_options, hierarchical and node_topology, plus the common ones."""


class DCD(Algorithm):
    """DCD-PSGD: mix exact neighbour models (kept as one weighted sum), step, send the compressed difference."""

    name = "dcd"
    config_class = DCDConfig
    takes_optimizer = True
    resize_family = "decentralized"
    resize_sharded = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        self.optimizer = self._local_sgd()
        check_float32(self.name, self.flat.data)
        codec = make_rank_codec(self.config, comm.rank)
        init = "model" if self.config.broadcast_init else "exchange"
        self.node_gossip = node_gossip_for(self.config, comm, self.flat.numel, self.flat.data)
        if self.node_gossip is None:
            self.gossip = SumGossip(comm, codec, self.flat.data, init)
            return
        if not self.config.broadcast_init:  # every rank of a node holds the node's model
            self.node_gossip.mix_with(self.flat.data, 0, lambda shard, step: None)
        self.shard = self.node_gossip.shard_of(self.flat.data)
        self.gossip = SumGossip(self.node_gossip.graph, codec, self.shard, init)
        self.before, self.mixed = torch.empty_like(self.shard), torch.empty_like(self.shard)  # reused every step

    def _step(self, grad: torch.Tensor) -> None:
        self._decayed(grad)
        update = self._user_update()
        if self.node_gossip is not None:
            self._two_level_step(update)
            return
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

    def _two_level_step(self, update: torch.Tensor | None) -> None:
        """The step between nodes on this rank's shard of y_a (see the module docstring)."""
        t, node = self.step_count, self.node_gossip.node
        topo = self.node_gossip.graph.topology(t)
        weight = topo.self_weight(node)
        before = self.before.copy_(self.shard)
        if self.gossip.lossless:
            gossip_average(self.mixed.copy_(before), self.gossip.models(before, t), weight,
                           topo.neighbor_weights(node))
        else:
            own, total = self.gossip.pair_at(t)
            torch.sub(before, own, out=self.mixed).mul_(weight).add_(total)
        self._apply_update(update)
        self.node_gossip.mix_with(self.flat.data, t, self._advance)

    def _advance(self, shard: torch.Tensor, step: int) -> None:
        """``shard`` (the node's mean of ``y_a + u_i``) <- y_a^{t+1}: the mix plus the mean update, then (lossy
        codecs) the compressed difference sent and added to the own public copy."""
        shard.sub_(self.before).add_(self.mixed)
        if not self.gossip.lossless:
            self.gossip.advance(shard, step + 1)
            shard.copy_(self.gossip.pair_at(step + 1)[0])

    def _extra_state(self):
        return {"optimizer": clone_optimizer_state(self.optimizer), "gossip": self.gossip.state_dict()}

    def _resize_rules(self):
        """On a resize the public copies x̂ and their weighted sums are re-derived for the new graph from the new
        replica."""
        return {**super()._resize_rules(), "extra.gossip.own_and_sum": public_copies}

    def _load_extra_state(self, extra):
        self.optimizer.load_state_dict(extra["optimizer"])
        self.gossip.load_state_dict(extra["gossip"])
