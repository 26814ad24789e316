"""Moniqua's round between nodes: the node's exact average, then the modulo-quantized round on each shard.

With L ranks on each of N nodes (:class:`~mpicomm.algorithms.shared.hierarchy.NodeGossip`), rank (node a,
local j) carries shard j of its node's average between nodes: a :class:`~.gossip.ModuloGossip` over the graph
of nodes whose tensors are the shard's parts of the model's tensors (its own codec, theta and guard). The
recovery needs ``|x̄_b - x̄_a| < theta`` between node averages, so theta's step statistic is the node's largest
local step per tensor part (one allreduce(max) inside the node). Used by Moniqua (on D-PSGD) and Moniqua-D².
"""

from __future__ import annotations

import torch

from ..shared.hierarchy import NodeGossip, ShardOfFlat, shard_layers
from .gossip import ModuloGossip
from .theta import local_step_sizes

__all__ = ["NodeModuloGossip"]


class NodeModuloGossip:
    """Moniqua's two-level round on ``flat``'s model over ``node_gossip``'s graph of nodes (``gossip``: this
    rank's ModuloGossip of its shard)."""

    def __init__(self, node_gossip: NodeGossip, config, flat):
        self.node_gossip = node_gossip
        counts, local = node_gossip.levels.counts, node_gossip.levels.layout.local_rank
        shards = [shard_layers(flat.layers, sum(counts[:j]), sum(counts[:j + 1])) for j in range(len(counts))]
        self.part_sizes = [part.numel for parts in shards for part in parts]  # every shard's tensor parts, in order
        first = sum(len(parts) for parts in shards[:local])
        self.own_parts = slice(first, first + len(shards[local]))
        own = ShardOfFlat(node_gossip.shard_of(flat.data), shards[local])
        self.gossip = ModuloGossip(node_gossip.graph, config, own)

    def step_sizes(self, direction: torch.Tensor, lr: float, optimizer=None) -> torch.Tensor:
        """Collective inside the node (unless lossless): the node's largest local step ``||lr (mu buf +
        direction)||_inf`` per tensor part of this rank's shard (theta's statistic)."""
        if self.gossip.identity:
            return torch.zeros(0)
        sizes = local_step_sizes(direction, lr, optimizer, self.part_sizes)
        return self.node_gossip.levels.node.allreduce(sizes, "max")[self.own_parts]

    def mix(self, x: torch.Tensor, step: int, sizes: torch.Tensor) -> bool:
        """Collective: the node's average of ``x``, Moniqua's round between nodes on this rank's shard, every shard
        back into ``x``; True if a part of this rank's shard wrapped (the guard mixed it with I)."""
        wrapped = []
        self.node_gossip.mix_with(x, step, lambda shard, s: wrapped.append(self.gossip.mix(shard, s, sizes)))
        return wrapped[0]
