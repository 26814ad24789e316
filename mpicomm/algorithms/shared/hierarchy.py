"""Two-level centralized exchange: exact inside the node, the method's exchange between nodes, per shard.

With ``L`` ranks on each of ``N`` nodes and the flat vector ``v_i`` of rank i, rank (node a, local j) runs::

    s_a[j] = sum_{i on node a} v_i[shard j]        reduce-scatter inside the node, full precision
    t[j]   = X_j(s_1[j], ..., s_N[j])             the method's exchange between the N ranks of local rank j
    v      = concat_j t[j]                         allgather inside the node, full precision

``X`` is a plain allreduce (AllReduce-SGD: ``t = sum_i v_i``, as flat, to float32 summation order) or a
codec's compressed allgather-and-sum (``compressed_sgd`` and its family: ``t[j] = sum_a decode(C(s_a[j]))``,
with error feedback on ``s_a[j]``). Each local rank exchanges its own shard, so all ``L`` NICs of a node
carry ``1/L`` of the inter-node traffic, as in Horovod's and NCCL's hierarchical allreduce, not one
leader's (Sergeev & Del Balso, "Horovod", 2018; Jia et al., "Highly scalable deep learning training
system with mixed-precision", 2018). What it means for convergence is in ``docs/network.md``.

``TwoLevelConfig.hierarchical``: ``None`` (auto) runs two levels when the run spans more than one node with
more than one rank on each and every node holds as many ranks (otherwise flat, bit for bit as before);
``True`` runs them whatever the layout (one node or one rank per node included; unequal nodes refused
with one line on every rank); ``False`` never. Not with ``overlap`` (auto picks flat; on is refused).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...comm import Communicator
from .buckets import OverlapConfig

__all__ = ["TwoLevel", "TwoLevelConfig", "two_level_for"]

_WORDS = {"auto": None, "on": True, "true": True, "yes": True, "off": False, "false": False, "no": False}


@dataclass(frozen=True)
class TwoLevelConfig(OverlapConfig):
    """hierarchical: exchange in two levels, an exact sum inside each node and the method's exchange between
    nodes on each local rank's shard (auto: on when the run spans more than one node with more than one rank
    on each; on; off). Not with overlap."""

    hierarchical: bool | None = None

    def __post_init__(self):
        super().__post_init__()
        value = self.hierarchical
        if isinstance(value, str):
            if value.strip().lower() not in _WORDS:
                raise ValueError(f"hierarchical must be auto, on or off, got {value!r}")
            object.__setattr__(self, "hierarchical", _WORDS[value.strip().lower()])
        elif value is not None and not isinstance(value, bool):
            raise TypeError(f"hierarchical must be a bool, None (auto) or auto/on/off, got {value!r}")
        if self.hierarchical and self.overlap:
            raise ValueError("hierarchical cannot be combined with overlap: the two-level exchange runs after "
                             "backward on the whole gradient; set one of them off")


class TwoLevel:
    """The two full-precision collectives inside the node around an exchange between nodes on a shard.

    ``cross`` is the Communicator of this rank's local rank across the nodes; ``lo``/``hi`` bound this rank's
    shard of a ``numel`` vector.
    """

    def __init__(self, comm: Communicator, numel: int, like: torch.Tensor):
        layout = comm.nodes
        self.layout = layout
        self.node, self.cross = layout.node, layout.cross
        self.counts = layout.counts(numel)
        self.lo, self.hi = layout.shard(numel)
        self.shard = torch.empty(self.hi - self.lo, dtype=like.dtype, device=like.device)

    def reduce(self, v: torch.Tensor) -> torch.Tensor:
        """Collective inside the node: this rank's shard of the node's sum of ``v`` (a buffer reused each call)."""
        return self.node.reduce_scatter(v, self.counts, out=self.shard)

    def spread(self, v: torch.Tensor, shard: torch.Tensor | None = None) -> torch.Tensor:
        """Collective inside the node: ``v[lo:hi] <- shard`` (unless it is there already), then every rank's
        shard into ``v``; returns ``v``."""
        if shard is not None:
            v[self.lo:self.hi].copy_(shard)
        return self.node.allgatherv_(v, self.counts)


def two_level_for(config: TwoLevelConfig, comm: Communicator, numel: int, like: torch.Tensor) -> TwoLevel | None:
    """Collective unless ``hierarchical`` is off: the :class:`TwoLevel` exchange ``config`` asks for, or None (flat)."""
    if config.hierarchical is False or (config.hierarchical is None and config.overlap):
        return None
    layout = comm.node_layout(require_equal=config.hierarchical is True)
    if config.hierarchical is None and not layout.two_level:
        return None
    return TwoLevel(comm, numel, like)
