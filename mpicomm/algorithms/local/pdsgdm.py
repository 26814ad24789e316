"""PD-SGDM and CPD-SGDM: decentralized momentum SGD that communicates once every p steps.

Gao, Huang. "Periodic Stochastic Gradient Descent with Momentum for Decentralized Training." 2020
(arXiv:2008.10435).

Step t on rank i (mu = ``momentum``, p = ``period``, r = (t + 1) / p - 1 the round, W that of
``comm.topology(r)``; the order and the round's topology: :mod:`~mpicomm.algorithms.shared.periodic`)::

    m_i <- mu m_i + g_i;   x_i <- x_i - alpha m_i                      (torch.optim.SGD, every step)
    if (t + 1) mod p == 0:
        PD-SGDM:   x_i <- sum_j W_ij x_j      (and m_i <- sum_j W_ij m_j if average_momentum)
        CPD-SGDM:  CHOCO-SGD's gossip (:mod:`~mpicomm.algorithms.decentralized.choco`)

Traffic on a communication step: PD-SGDM 4d bytes (8d with average_momentum), CPD-SGDM
``codec.payload_bytes(d)``, to each out-neighbour; nothing otherwise. PD-SGDM(period=1, momentum=0,
order="cta") is ``dpsgd`` bit for bit. Defaults and reductions: ``docs/algorithms/decentralized.md``.

``overlap=True`` (with ``order="cta"``): a communication step's message is x(t) (CPD-SGDM: C(x(t) - x̂)),
known before the gradient, so ``begin_step()`` posts it before the forward pass and ``step()`` completes
the round -- bit for bit the blocking step; local-only steps post nothing. With ``order="atc"`` the
message holds this step's gradient, and with ``average_momentum`` the momentum buffer updated by it, so
both refuse ``overlap``.

PD-SGDM's ``hierarchical`` (auto: on over several nodes of several ranks; not with ``overlap``) makes each
round two-level: the node's exact average, then one gossip round on the graph of nodes (``node_topology``),
for x and, with ``average_momentum``, for m (:mod:`~mpicomm.algorithms.shared.hierarchy`): the mixing matrix
``W_nodes ⊗ (1/L) 1 1ᵀ``, doubly stochastic when ``W_nodes`` is, with its spectral gap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import check_bool
from ..decentralized.choco import CHOCO, ChocoConfig
from ..shared.gossip import gossip_average
from ..shared.hierarchy import NodeGraphConfig, node_gossip_for
from ..shared.periodic import OrderConfig, PeriodicGossip, check_period

__all__ = ["CPDSGDM", "CPDSGDMConfig", "PDSGDM", "PDSGDMConfig"]


@dataclass(frozen=True)
class PDSGDMConfig(NodeGraphConfig, OrderConfig):
    """PD-SGDM options (momentum mu in [0, 1) defaults to 0.9).

    period: local steps between two gossip rounds, p >= 1. average_momentum: gossip the momentum buffers
    too. overlap: with order="cta", post a communication step's exchange of x(t) in begin_step(), before the
    forward pass, and finish the round in step() (bit for bit the blocking step).
    """

    momentum: float = 0.9
    period: int = 4
    average_momentum: bool = False
    overlap: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_period(self.period)
        if not isinstance(self.average_momentum, bool):
            raise ValueError(f"average_momentum must be a bool, got {self.average_momentum!r}")
        if self.average_momentum and self.momentum == 0:
            raise ValueError("average_momentum=True needs momentum > 0 (there is no momentum buffer to average)")
        check_bool("overlap", self.overlap)
        if self.overlap and (self.order != "cta" or self.average_momentum):
            raise ValueError("overlap=True needs order='cta' and average_momentum=False: otherwise the message "
                             "holds this step's gradient, so it cannot leave before the backward pass")


class PDSGDM(PeriodicGossip):
    """PD-SGDM: local momentum SGD steps and full-precision gossip every ``period``-th step."""

    name = "pdsgdm"
    config_class = PDSGDMConfig
    resize_family = "decentralized"

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        if self.config.average_momentum:  # a zero buffer from the start, so round 0 can average it
            param = self.optimizer.param_groups[0]["params"][0]
            self.optimizer.state[param]["momentum_buffer"] = torch.zeros_like(self.flat.data)
        self.node_gossip = node_gossip_for(self.config, comm, self.flat.numel, self.flat.data)

    def _check_user_optimizer(self, optimizer):
        if self.config.average_momentum:
            raise ValueError("pdsgdm: average_momentum=True averages the built-in SGD's momentum buffer; "
                             "it cannot be combined with optimizer=")

    def _momentum_buffer(self) -> torch.Tensor:
        return self.optimizer.state[self.optimizer.param_groups[0]["params"][0]]["momentum_buffer"]

    def _begin_exchange(self):
        round_index = self._round_at(self.step_count)
        if not self.config.overlap or round_index is None:
            return None
        return self.comm.ineighbor_allgather(self.flat.data, step=round_index)

    def _gossip(self, round_index: int) -> None:
        x, rank = self.flat.data, self.comm.rank
        if self.node_gossip is not None:
            self.node_gossip.mix(x, round_index)
            if self.config.average_momentum:
                self.node_gossip.mix(self._momentum_buffer(), round_index)
            return
        topo = self.comm.topology(round_index)
        self_weight, weights = topo.self_weight(rank), topo.neighbor_weights(rank)
        if not self.config.average_momentum:
            pending = self._take_pending()
            received = self.comm.neighbor_allgather(x, step=round_index) if pending is None else pending.wait()
            gossip_average(x, received, self_weight, weights)
            return
        buf = self._momentum_buffer()
        received = self.comm.neighbor_allgather(torch.stack((x, buf)), step=round_index)
        gossip_average(x, received[:, 0], self_weight, weights)
        gossip_average(buf, received[:, 1], self_weight, weights)


@dataclass(frozen=True)
class CPDSGDMConfig(ChocoConfig):
    """CPD-SGDM options: CHOCO's (codec, codec_options, gamma, order); momentum defaults to 0.9.

    period: local steps between two compressed gossip rounds, p >= 1.
    """

    momentum: float = 0.9
    period: int = 4

    def __post_init__(self):
        super().__post_init__()
        check_period(self.period)


class CPDSGDM(CHOCO):
    """CPD-SGDM: local momentum SGD steps and CHOCO compressed gossip every ``period``-th step."""

    name = "cpdsgdm"
    config_class = CPDSGDMConfig
