"""Decentralized DiLoCo: DiLoCo's allreduce replaced by gossip with the graph neighbours; no all-rank collective.

Step t on rank i (H = ``period``, k = ``gossip_rounds``, W^(r) the mixing matrix of ``comm.topology(r)``;
every rank keeps its own global copy x_g,i and outer optimizer)::

    x_i <- InnerOpt(x_i, g_i)                       (as in DiLoCo: torch.optim.SGD or yours)
    if (t + 1) mod H == 0 (sync s = (t + 1) / H - 1):
        y_i = [W^(sk + k - 1) ... W^(sk)] x_i        (k gossip rounds of the local models)
        Delta_i = x_g,i - y_i = sum_j W_ij Delta_j + (x_g,i - sum_j W_ij x_g,j)    (for k = 1)
        x_g,i <- outer Nesterov SGD step on Delta_i;   x_i <- x_g,i

What is gossiped is x_i = x_g,i - Delta_i, not Delta_i alone: averaging only the pseudo-gradients would leave
the x_g,i uncoupled, so the pseudo-gradient also carries each rank's consensus error. With W = J/n it is
``diloco``. PD-SGDM averages the models every p steps and keeps its momentum local: with outer_lr = 1,
outer_momentum = 0, k = 1 this method is ``pdsgdm`` (order "atc") up to rounding; otherwise the models'
average goes through an outer Nesterov step. Analysis: with outer_lr = 1 and outer_momentum = 0 (any inner
SGD momentum aside) it is local-update decentralized SGD with periodic gossip, covered by Koloskova et al.
"A Unified Theory of Decentralized SGD with Changing Topology and Local Updates" (ICML 2020); the outer
momentum and outer_lr != 1 are not covered by that analysis. Traffic per sync: k messages of 4d bytes to
each out-neighbour. Options and reasoning: ``docs/algorithms/diloco.md``.

``hierarchical`` (auto: on over several nodes of several ranks; ``node_topology``): each gossip round is the
node's exact average then one round on the graph of nodes, each local rank carrying its shard
(:mod:`~mpicomm.algorithms.shared.hierarchy`): the mixing matrix ``W_nodes ⊗ (1/L) 1 1ᵀ``, doubly stochastic
with the spectral gap of ``W_nodes`` -- Koloskova et al.'s analysis with the graph of nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base import check_int
from ..shared.gossip import gossip_average
from ..shared.hierarchy import NodeGraphConfig, node_gossip_for
from .diloco import OuterLoop, OuterMomentumConfig

__all__ = ["DecentralizedDiLoCo", "DecentralizedDiLoCoConfig"]


@dataclass(frozen=True)
class DecentralizedDiLoCoConfig(NodeGraphConfig, OuterMomentumConfig):
    """Decentralized DiLoCo options (DiLoCo's outer step). gossip_rounds: gossip rounds per sync, >= 1.
    hierarchical, node_topology: see the module docstring."""

    gossip_rounds: int = 1

    def __post_init__(self):
        super().__post_init__()
        check_int("gossip_rounds", self.gossip_rounds, 1)


class DecentralizedDiLoCo(OuterLoop):
    """Decentralized DiLoCo: H inner steps, gossip of the local models, a per-rank outer Nesterov step."""

    name = "decentralized_diloco"
    config_class = DecentralizedDiLoCoConfig
    resize_family = "decentralized"

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        self.node_gossip = node_gossip_for(self.config, comm, self.flat.numel, self.flat.data)

    def _average(self, delta, round_index):
        x, rank, k = self.flat.data, self.comm.rank, self.config.gossip_rounds
        for r in range(round_index * k, round_index * k + k):
            if self.node_gossip is not None:
                self.node_gossip.mix(x, r)
                continue
            topo = self.comm.topology(r)
            gossip_average(x, self.comm.neighbor_allgather(x, step=r), topo.self_weight(rank),
                           topo.neighbor_weights(rank))
        delta.copy_(self.global_params).sub_(x)
