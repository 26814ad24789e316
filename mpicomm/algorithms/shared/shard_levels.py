"""The sharded exchange in two levels, when ranks share a node: exact inside the node, sharded between nodes.

With L ranks on each of N nodes, rank (node a, local j) -- ZeRO++'s hierarchical partitioning of the gradient
(Wang et al., 2023) over :class:`~.hierarchy.TwoLevel`::

    s_a[j]    = sum_{i on node a} g_i[node shard j]        reduce-scatter inside the node, fp32
    t[j][a]   = sum_b s_b[j][sub-shard a]                  :class:`~.shard_exchange.ShardedSum` between the N
                                                           ranks of local rank j (exact, or 4/8-bit)
    the owner steps sub-shard a of node shard j, then      :class:`~.shard_gather.ShardedGather` between nodes
    x[node shard j] <- gathered; x <- allgatherv inside the node, fp32

So rank (a, j) owns sub-shard a of node shard j: a contiguous range, though not in rank order. Only a 1/L share
of the gradient leaves each rank for the slow network and all L NICs of a node carry it; an fp32 exchange with
``shard_order="exact"`` sums in the order of the unsharded two-level allreduce (the node's reduce-scatter, then
MPICH's allreduce order between nodes), so it trains bit for bit as ``hierarchical`` without ``shard``. A quantized
exchange keeps its error feedback on the node sum's shard (d / L elements).
"""

from __future__ import annotations

import torch

from .hierarchy import TwoLevel
from .shard_exchange import ShardedSum
from .shard_gather import ShardedGather

__all__ = ["NodeShardedGather", "NodeShardedSum"]


class NodeShardedSum:
    """The reduce-scatter in two levels: this rank's sub-shard ``[lo, hi)`` of the sum over all ranks."""

    def __init__(self, levels: TwoLevel, bits: int, seed: int, like: torch.Tensor, order: str = "fast"):
        self.levels = levels
        self.between = ShardedSum(levels.cross, levels.hi - levels.lo, bits, seed, like, order)
        self.layout = self.between.layout
        self.lo, self.hi = levels.lo + self.between.lo, levels.lo + self.between.hi

    def reduce_scatter(self, grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Collective: ``out <- sum over ranks of grad[lo:hi]``; ``grad`` is read only (the node's sum, which the
        exchange between nodes spends in the exact order, is not)."""
        return self.between.reduce_scatter(self.levels.reduce(grad), out)

    def state_dict(self) -> dict:
        """The exchange between nodes' residual (of the node sum's shard) and generator (empty when exact)."""
        return self.between.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        self.between.load_state_dict(state)


class NodeShardedGather:
    """The parameter gather in two levels: between nodes on the node shard, then allgatherv inside the node."""

    def __init__(self, levels: TwoLevel, layout, bits: int, seed: int, like: torch.Tensor):
        self.levels = levels
        self.between = ShardedGather(levels.cross, layout, bits, seed, like)

    def _node_shard(self, data: torch.Tensor) -> torch.Tensor:
        return data[self.levels.lo:self.levels.hi]

    def exact(self, data: torch.Tensor) -> None:
        """Collective: every owner's range of ``data`` to every rank, fp32."""
        self.between.exact(self._node_shard(data))
        self.levels.spread(data)

    def remember(self, data: torch.Tensor) -> None:
        """Before the owner's step (see :meth:`.ShardedGather.remember`)."""
        self.between.remember(self._node_shard(data))

    def gather(self, data: torch.Tensor) -> None:
        """Collective, after the owner's step: every stepped range to every rank (exact or quantized between nodes)."""
        self.between.gather(self._node_shard(data))
        self.levels.spread(data)

    def state_dict(self) -> dict:
        """The gather between nodes' residual and generator (empty when exact)."""
        return self.between.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        self.between.load_state_dict(state)
