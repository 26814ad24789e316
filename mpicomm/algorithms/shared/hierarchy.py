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

Two-level gossip (:class:`NodeGossip`, for D-PSGD, D², PD-SGDM, CHOCO, CPD-SGDM, DCD and Moniqua): the node's
exact average, then one gossip round of the method between nodes on the graph of nodes ``W_nodes`` (ring,
exponential, ... over node ids), each local rank carrying its shard, as BlueFog's
``hierarchical_neighbor_allreduce``. For a
full-precision round, with ranks ordered by node its mixing matrix is
``W = W_nodes ⊗ (1/L) 1 1ᵀ``: symmetric and doubly stochastic when ``W_nodes`` is, with the eigenvalues of
``W_nodes`` and zeros, so the second largest ``|λ|`` of ``W`` is that of ``W_nodes`` -- the consensus runs
over ``N`` nodes instead of ``N L`` ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import topology as topologies
from ...comm import Communicator
from ...flat import Layer
from ..base import AlgorithmConfig, GossipOverlapConfig
from .buckets import OverlapConfig
from .gossip import gossip_average

__all__ = ["GossipTwoLevelConfig", "HierarchicalConfig", "NodeGossip", "NodeGraphConfig", "ShardOfFlat", "TwoLevel",
           "TwoLevelConfig", "group_layers", "layer_aligned_counts", "node_gossip_for", "node_topology_for",
           "mean_over_ranks", "shard_layers", "two_level_for"]

_WORDS = {"auto": None, "on": True, "true": True, "yes": True, "off": False, "false": False, "no": False}


@dataclass(frozen=True)
class HierarchicalConfig(AlgorithmConfig):
    """hierarchical: exchange in two levels, exact inside each node and the method's exchange between nodes on
    each local rank's shard (auto: on when the run spans more than one node with more than one rank on each;
    on; off). Not with overlap."""

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
        if self.hierarchical and getattr(self, "overlap", False):
            raise ValueError("hierarchical cannot be combined with overlap: the two-level exchange needs the whole "
                             "vector before the exchange between nodes; set one of them off")


@dataclass(frozen=True)
class TwoLevelConfig(HierarchicalConfig, OverlapConfig):
    """The options of a centralized method with bucket overlap and a two-level exchange."""


@dataclass(frozen=True)
class NodeGraphConfig(HierarchicalConfig):
    """node_topology: the graph of nodes of the two-level gossip (a topology name such as ring or exponential;
    default: the run's topology kind over the nodes)."""

    node_topology: str | None = None

    def __post_init__(self):
        super().__post_init__()
        name = self.node_topology
        if name is not None and (not isinstance(name, str) or name not in topologies.TOPOLOGIES):
            raise ValueError(f"node_topology must be one of {', '.join(sorted(topologies.TOPOLOGIES))}, "
                             f"got {name!r}")


@dataclass(frozen=True)
class GossipTwoLevelConfig(NodeGraphConfig, GossipOverlapConfig):
    """The options of a gossip method with overlap and a two-level gossip."""


class TwoLevel:
    """The two full-precision collectives inside the node around an exchange between nodes on a shard.

    ``cross`` is the Communicator of this rank's local rank across the nodes; ``lo``/``hi`` bound this rank's
    shard of a ``numel`` vector: equal shards, or with ``layers`` (the flat buffer's tensors) shards of whole
    tensors (:func:`layer_aligned_counts`), for methods that need a tensor's shape.
    """

    def __init__(self, comm: Communicator, numel: int, like: torch.Tensor, layers=None):
        layout = comm.nodes
        self.layout = layout
        self.node, self.cross = layout.node, layout.cross
        self.counts = layout.counts(numel) if layers is None else layer_aligned_counts(layers, layout.local_size)
        self.lo = sum(self.counts[:layout.local_rank])
        self.hi = self.lo + self.counts[layout.local_rank]
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

    def allreduce(self, v: torch.Tensor) -> torch.Tensor:
        """Collective: ``v`` <- its sum over all ranks, in place (node sum, allreduce of the shard between
        nodes, allgather inside the node); returns ``v``."""
        return self.spread(v, self.cross.allreduce(self.reduce(v)))


def mean_over_ranks(v: torch.Tensor, comm: Communicator, levels: TwoLevel | None) -> torch.Tensor:
    """Collective: ``v`` <- its exact mean over all of ``comm``'s ranks, in place, in two levels through
    ``levels`` when it is set, else by one flat allreduce; returns ``v``."""
    (comm if levels is None else levels).allreduce(v)
    return v.div_(comm.size)


def _levels_wanted(config, comm: Communicator):
    """Collective unless ``hierarchical`` is off: the node layout when ``config`` asks for two levels, else None
    (also for a config without the option, such as a 1-bit method's, whose warm-up shares the code)."""
    if not isinstance(config, HierarchicalConfig) or config.hierarchical is False:
        return None
    if config.hierarchical is None and getattr(config, "overlap", False):
        return None
    if config.hierarchical is None and not comm.spans_nodes():
        return None
    return comm.node_layout(require_equal=config.hierarchical is True)


def two_level_for(config: HierarchicalConfig, comm: Communicator, numel: int,
                  like: torch.Tensor, layers=None) -> TwoLevel | None:
    """Collective unless ``hierarchical`` is off: the :class:`TwoLevel` exchange ``config`` asks for, or None (flat).
    ``layers``: shards of whole tensors."""
    if _levels_wanted(config, comm) is None:
        return None
    return TwoLevel(comm, numel, like, layers)


def layer_aligned_counts(layers, parts: int) -> list[int]:
    """Elements of ``parts`` consecutive groups of whole tensors ``layers`` (in flat order): group j ends at the
    tensor edge nearest to ``(j + 1) / parts`` of the total, so the groups are as even as whole tensors allow
    (a group may be empty when one tensor outweighs several shares)."""
    edges = [0]
    for layer in layers:
        edges.append(edges[-1] + layer.numel)
    total, cuts = edges[-1], [0]
    for j in range(1, parts):
        target = total * j / parts
        cuts.append(max(cuts[-1], min(edges, key=lambda e: (abs(e - target), e))))
    cuts.append(total)
    return [b - a for a, b in zip(cuts, cuts[1:])]


def group_layers(layers, lo: int, hi: int) -> list[Layer]:
    """The tensors of ``layers`` that lie wholly inside ``[lo, hi)``, shapes kept and offsets from ``lo`` (the
    group of a :func:`layer_aligned_counts` shard)."""
    return [Layer(layer.name, layer.offset - lo, layer.shape) for layer in layers
            if lo <= layer.offset and layer.offset + layer.numel <= hi and layer.numel]


class NodeGossip:
    """Two-level gossip: ``x`` replaced by one gossip round over the graph of nodes of its node's average.

    Per call, on this rank's shard ``[lo, hi)``: ``s = (1/L) sum_{i on node} x_i[lo:hi]`` (reduce-scatter
    inside the node), ``s <- W_nodes[a, a] s + sum_b W_nodes[a, b] s_b`` (neighbour allgather between the
    ranks of this local rank on the neighbouring nodes), then every shard back into ``x`` (allgather inside
    the node). ``node_topology``: the graph of nodes, one vertex per node. ``layers``: shards of whole tensors.
    """

    def __init__(self, comm: Communicator, numel: int, like: torch.Tensor, node_topology, layers=None):
        self.levels = TwoLevel(comm, numel, like, layers)
        layout = self.levels.layout
        self.graph = layout.cross.on_graph(node_topology)
        self.node, self.ranks_per_node = layout.node_index, layout.local_size

    def shard_of(self, x: torch.Tensor) -> torch.Tensor:
        """The part of ``x`` this rank carries between nodes (a view)."""
        return x[self.levels.lo:self.levels.hi]

    def mix_with(self, x: torch.Tensor, step: int, gossip) -> torch.Tensor:
        """Collective: the node average of ``x``'s shard, ``gossip(shard, step)`` on it in place (a gossip round
        of the method over ``self.graph``), then every shard back into ``x``; returns ``x``."""
        shard = self.levels.reduce(x).div_(self.ranks_per_node)
        gossip(shard, step)
        return self.levels.spread(x, shard)

    def mix(self, x: torch.Tensor, step: int, gamma: float = 1.0) -> torch.Tensor:
        """Collective: ``x <- (W_nodes ⊗ (1/L) 1 1ᵀ) x`` in place (this rank's row; ``W_nodes`` damped to ``(1 -
        gamma) I + gamma W_nodes``); returns ``x``."""
        return self.mix_with(x, step, lambda shard, s: self._average(shard, s, gamma))

    def _average(self, shard: torch.Tensor, step: int, gamma: float) -> None:
        topo = self.graph.topology(step)
        received = self.graph.neighbor_allgather(shard, step=step)
        gossip_average(shard, received, topo.self_weight(self.node), topo.neighbor_weights(self.node), gamma)


def shard_layers(layers, lo: int, hi: int) -> list[Layer]:
    """The parts of the flat buffer's tensors ``layers`` inside ``[lo, hi)``, as 1-D tensors of the shard (offsets
    from ``lo``; each keeps its tensor's name), in order: what a per-tensor codec sees of a shard."""
    parts = []
    for layer in layers:
        start, stop = max(layer.offset, lo), min(layer.offset + layer.numel, hi)
        if start < stop:
            parts.append(Layer(layer.name, start - lo, (stop - start,)))
    return parts


@dataclass(frozen=True)
class ShardOfFlat:
    """A shard of a flat buffer as a per-tensor method sees a model: ``data`` (a view) and its ``layers``."""

    data: torch.Tensor
    layers: list


def node_topology_for(config: NodeGraphConfig, schedule, n_nodes: int):
    """The graph of ``n_nodes`` nodes ``config`` asks for: ``node_topology``, else the kind of ``schedule``."""
    name = config.node_topology
    if name is None:
        name = schedule.name.split("(")[0]
        if name not in topologies.TOPOLOGIES:
            raise ValueError(f"the run's topology {schedule.name} has no form over nodes: set node_topology to one "
                             f"of {', '.join(sorted(topologies.TOPOLOGIES))}")
    try:
        return topologies.build(name, n_nodes)
    except ValueError as exc:
        raise ValueError(f"node_topology {name} over {n_nodes} nodes: {exc}") from None


def node_gossip_for(config: NodeGraphConfig, comm: Communicator, numel: int,
                    like: torch.Tensor, layers=None) -> NodeGossip | None:
    """Collective unless ``hierarchical`` is off: the :class:`NodeGossip` ``config`` asks for, or None (flat).
    ``layers``: shards of whole tensors."""
    layout = _levels_wanted(config, comm)
    if layout is None:
        return None
    return NodeGossip(comm, numel, like, node_topology_for(config, comm.schedule, layout.n_nodes), layers)
