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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import check_range
from ..shared.codec_options import CodecConfig, make_rank_codec
from ..shared.gossip import gossip_average
from ..shared.periodic import OrderConfig, PeriodicGossip
from ..shared.public_sum import SumGossip

__all__ = ["CHOCO", "ChocoConfig", "choco_consensus"]


@dataclass(frozen=True)
class ChocoConfig(CodecConfig, OrderConfig):
    """CHOCO options (codec, codec_options and order as below).

    gamma: consensus step size in (0, 1].
    """

    gamma: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        check_range("gamma", self.gamma, lo=0.0, hi=1.0, lo_open=True)


def choco_consensus(x: torch.Tensor, gossip: SumGossip, step: int, gamma: float) -> None:
    """One CHOCO gossip round over ``comm.topology(step)``, updating ``x`` in place (see the module docstring)."""
    comm = gossip.comm
    topo = comm.topology(step)
    self_weight, weights = topo.self_weight(comm.rank), topo.neighbor_weights(comm.rank)
    if gossip.lossless:
        rows = gossip.models(x, step)
        if gamma == 1.0:
            gossip_average(x, rows, self_weight, weights)
            return
        mixed = gossip_average(gossip.scratch.copy_(x), rows, self_weight, weights).sub_(x)
    else:
        gossip.advance(x, step)
        own, total = gossip.pair_at(step)
        mixed = torch.sub(total, own, out=gossip.scratch)
    x.add_(mixed, alpha=gamma)


class CHOCO(PeriodicGossip):
    """CHOCO-SGD: a local SGD step, then a compressed gossip step on public copies, every step."""

    name = "choco"
    config_class = ChocoConfig

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        codec = make_rank_codec(self.config, comm.rank)
        self.gossip = SumGossip(comm, codec, self.flat.data, "model" if self.config.broadcast_init else "zeros")

    def _gossip(self, round_index: int) -> None:
        choco_consensus(self.flat.data, self.gossip, round_index, self.config.gamma)

    def _extra_state(self):
        return {**super()._extra_state(), "gossip": self.gossip.state_dict()}

    def _load_extra_state(self, extra):
        super()._load_extra_state(extra)
        self.gossip.load_state_dict(extra["gossip"])
