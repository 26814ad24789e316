"""CHOCO-SGD: decentralized SGD with compressed gossip on public copies.

Koloskova, Stich, Jaggi. "Decentralized Stochastic Optimization and Gossip Algorithms with Compressed
Communication." ICML 2019.

Step t on rank i (W the mixing matrix of ``comm.topology(t)``, C the codec, gamma the consensus step)::

    x_i <- x_i - alpha g_i                                  (torch SGD step; momentum if configured)
    q_i = C(x_i - x̂_i);   send q_i;   x̂_j <- x̂_j + q_j   for j in N(i), own copy included
    x_i <- x_i + gamma * sum_j W_ij (x̂_j - x̂_i)

Only x̂_i and s_i = sum_j W_ij x̂_j are stored (:mod:`~mpicomm.algorithms.shared.public_sum`), per
distinct topology of the schedule. order="atc" is the paper's; "cta" gossips first (D-PSGD's order).
Traffic: ``codec.payload_bytes(d)`` to each out-neighbour per step. With the identity codec and gamma = 1,
order="cta" is ``dpsgd`` bit for bit. Details: ``docs/algorithms/decentralized.md``.

``overlap=True`` (order="cta" only): x_i is gossiped before the local step there, and the gradient is
taken at the same x_i, so ``begin_step()`` encodes q_i = C(x_i - x̂_i), adds it to x̂_i and s_i and posts
the exchange before the forward pass; ``step()`` waits, adds the neighbours' W_ij q_j and finishes as the
blocking step does (same codec draws, same sums in the same order: bit for bit). Under order="atc" the
message is C(x_i - alpha g_i - x̂_i): it needs the gradient, and there is nothing to overlap.

``hierarchical`` (auto: on over several nodes of several ranks; not with ``overlap``): each round is the
node's exact average, then CHOCO's compressed round between nodes on the graph of nodes (``node_topology``),
each local rank carrying its shard with its own public copies of it, then the allgather inside the node
(:mod:`~mpicomm.algorithms.shared.hierarchy`). The nodes are CHOCO's participants: its analysis holds for
the N node averages with the spectral gap of ``W_nodes``; the exact average inside the node is lossless.
Per rank and round: the node's reduce-scatter and allgather in full precision, and the codec's payload of
its shard (about d/L elements) to each neighbouring node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...checkpoint.resize_rules import public_copies
from ...codecs.base import check_float32
from ..base import check_bool, check_range
from ..shared.codec_options import CodecConfig, make_rank_codec
from ..shared.gossip import gossip_average
from ..shared.hierarchy import NodeGraphConfig, node_gossip_for
from ..shared.periodic import OrderConfig, PeriodicGossip
from ..shared.public_sum import SumGossip

__all__ = ["CHOCO", "ChocoConfig", "begin_choco_consensus", "choco_consensus"]


@dataclass(frozen=True)
class ChocoConfig(NodeGraphConfig, CodecConfig, OrderConfig):
    """CHOCO options (codec, codec_options and order as below).

    gamma: consensus step size in (0, 1]. overlap: with order="cta", encode and send C(x - x̂) in
    begin_step(), before the forward pass, and finish the round in step() (bit for bit the blocking step);
    with "atc" the message needs this step's gradient, so overlap=True is refused.
    """

    gamma: float = 0.5
    overlap: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_range("gamma", self.gamma, lo=0.0, hi=1.0, lo_open=True)
        check_bool("overlap", self.overlap)
        if self.overlap and self.order != "cta":
            raise ValueError("overlap=True needs order='cta': with order='atc' the message C(x - alpha g - x̂) "
                             "depends on this step's gradient, so it cannot leave before the backward pass")


def begin_choco_consensus(x: torch.Tensor, gossip: SumGossip, step: int):
    """Encode ``q = C(x - x̂_i)`` (or, lossless, ``x``) and post round ``step``'s exchange non-blocking; returns
    the ``pending`` that :func:`choco_consensus` completes. ``x`` must not change until then."""
    return gossip.post_models(x, step) if gossip.lossless else gossip.post_advance(x, step)


def choco_consensus(x: torch.Tensor, gossip: SumGossip, step: int, gamma: float, pending=None) -> None:
    """One CHOCO gossip round over ``comm.topology(step)``, updating ``x`` in place (see the module docstring).

    ``pending``: what :func:`begin_choco_consensus` returned for this ``x`` and round (None: exchange now).
    """
    comm = gossip.comm
    topo = comm.topology(step)
    self_weight, weights = topo.self_weight(comm.rank), topo.neighbor_weights(comm.rank)
    if gossip.lossless:
        rows = gossip.models(x, step, pending)
        if gamma == 1.0:
            gossip_average(x, rows, self_weight, weights)
            return
        mixed = gossip_average(gossip.scratch.copy_(x), rows, self_weight, weights).sub_(x)
    else:
        if pending is None:
            gossip.advance(x, step)
        else:
            gossip.finish_advance(pending, step)
        own, total = gossip.pair_at(step)
        mixed = torch.sub(total, own, out=gossip.scratch)
    x.add_(mixed, alpha=gamma)


class CHOCO(PeriodicGossip):
    """CHOCO-SGD: a local SGD step, then a compressed gossip step on public copies, every step."""

    name = "choco"
    config_class = ChocoConfig
    resize_family = "decentralized"
    resize_sharded = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        check_float32(self.name, self.flat.data)
        codec = make_rank_codec(self.config, comm.rank)
        init = "model" if self.config.broadcast_init else "zeros"
        self.node_gossip = node_gossip_for(self.config, comm, self.flat.numel, self.flat.data)
        if self.node_gossip is None:
            self.gossip = SumGossip(comm, codec, self.flat.data, init)
        else:  # public copies of this rank's shard, among the same local ranks of the neighbouring nodes
            self.gossip = SumGossip(self.node_gossip.graph, codec, self.node_gossip.shard_of(self.flat.data), init)

    def _begin_exchange(self):
        round_index = self._round_at(self.step_count)
        if not self.config.overlap or round_index is None:
            return None
        return begin_choco_consensus(self.flat.data, self.gossip, round_index)

    def _gossip(self, round_index: int) -> None:
        if self.node_gossip is not None:
            self.node_gossip.mix_with(self.flat.data, round_index, self._consensus)
            return
        choco_consensus(self.flat.data, self.gossip, round_index, self.config.gamma, self._take_pending())

    def _consensus(self, shard: torch.Tensor, round_index: int) -> None:
        choco_consensus(shard, self.gossip, round_index, self.config.gamma)

    def _extra_state(self):
        return {**super()._extra_state(), "gossip": self.gossip.state_dict()}

    def _resize_rules(self):
        """On a resize the public copies x̂ and their weighted sums are re-derived for the new graph from the new
        replica."""
        return {**super()._resize_rules(), "extra.gossip.own_and_sum": public_copies}

    def _load_extra_state(self, extra):
        super()._load_extra_state(extra)
        self.gossip.load_state_dict(extra["gossip"])
