"""CHOCO-SGD: decentralized SGD with compressed gossip on public copies.

Koloskova, Stich, Jaggi. "Decentralized Stochastic Optimization and Gossip Algorithms with Compressed
Communication." ICML 2019.

Step t on rank i (W the mixing matrix of ``comm.topology(t)``, C the codec, gamma the consensus step)::

    x_i <- x_i - alpha g_i                                  (torch SGD step; momentum if configured)
    q_i = C(x_i - x̂_i);   send q_i;   x̂_j <- x̂_j + q_j   for j in N(i), own copy included
    x_i <- x_i + gamma * sum_j W_ij (x̂_j - x̂_i)

Only x̂_i and s_i = sum_j W_ij x̂_j (j in N(i) and i) are stored, as in the paper's memory-efficient
form (rows of W sum to 1, so the last line is x_i <- x_i + gamma (s_i - x̂_i)); receiving q_j adds
W_ij q_j to s_i (:mod:`.public_sum`)::

    x̂_i <- x̂_i + q_i;   s_i <- s_i + W_ii q_i + sum_{j in N(i)} W_ij q_j;   x_i <- x_i + gamma (s_i - x̂_i)

This is order="atc", the paper's form; order="cta" runs the gossip lines first and the SGD step
(with the gradient taken at the pre-gossip iterate) after them, which is D-PSGD's order. The public
copies start at the common initial model (``broadcast_init=True``; every rank holds the same one, so
the copies agree) or at zero (the paper's choice, used when ``broadcast_init=False``). (x̂_i, s_i) is
kept per distinct topology of a time-varying schedule; see :mod:`.public_sum`.

Traffic: ``codec.payload_bytes(d)`` to each out-neighbour per step.

Memory beyond the model and the optimizer: 2 model copies (x̂_i, s_i) per distinct topology of the
schedule, whatever the degree, plus one d-element scratch vector; received payloads are compressed.

Exact reduction: with the lossless ``identity`` codec the copies would always equal the models, so
the model itself is sent and ``x_i <- W_ii x_i + sum_j W_ij x_j`` is applied with the same
``gossip_average`` as D-PSGD when gamma = 1. Hence CHOCO(identity, gamma=1, order="cta") is the
registered ``dpsgd`` and CHOCO(identity, gamma=1) is PD-SGDM(period=1), bit for bit.

With a user optimizer (``optimizer=opt``) its update replaces the SGD line; see :mod:`.periodic`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import check_range
from .dpsgd import gossip_average
from .periodic import OrderConfig, PeriodicGossip
from .public_sum import SumGossip
from .registry import register
from .replicas import CodecConfig, make_rank_codec

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


@register
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
