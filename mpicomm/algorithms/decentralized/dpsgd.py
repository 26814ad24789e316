"""D-PSGD: decentralized parallel SGD with full-precision gossip.

Lian, Zhang, Zhang, Hsieh, Zhang, Liu. "Can Decentralized Algorithms Outperform Centralized
Algorithms? A Case Study for Decentralized Parallel Stochastic Gradient Descent." NeurIPS 2017.

Update at step t on rank i (W_t the mixing matrix in force at step t, g_i the stochastic gradient
at x_i, plus weight_decay * x_i)::

    x_i <- sum_j W_t[i, j] x_j - alpha * g_i          (with momentum: m_i <- mu m_i + g_i; use m_i)

With a user optimizer (``make_algorithm("dpsgd", model, comm, optimizer=opt)``) the local step is the
optimizer's update at the current iterate, taken in place of ``-alpha g_i`` (its groups' weight decay,
lr and state apply; g_i is the plain gradient)::

    d_i = opt.step(x_i, g_i) - x_i;     x_i <- sum_j W_t[i, j] x_j + d_i

One ``neighbor_allgather`` of the full fp32 model per step. Memory beyond the model: the receive
buffer (in-degree x d) and, with momentum, torch's momentum buffer. This is the reference every
compressed decentralized algorithm reduces to with the identity codec.

``overlap=True``: the neighbours' models and the local gradient are both taken at x(t), so
:meth:`~mpicomm.algorithms.base.Algorithm.begin_step` posts the exchange of x(t) (``ineighbor_allgather``)
before the forward pass and ``step()`` waits for it, mixes and steps: the same sums in the same order as
the blocking step, so bit for bit the same parameters; the transfer is hidden behind forward and backward.
Without a ``begin_step()`` the step exchanges blocking, as with ``overlap=False``.

``hierarchical`` (auto: on over several nodes of several ranks; :mod:`~mpicomm.algorithms.shared.hierarchy`)
mixes in two levels: the exact average of the node, then one gossip round between nodes on the graph of
nodes (``node_topology``, by default the run's topology kind over the nodes), each local rank carrying its
shard of the model::

    x_i <- sum_b W_nodes[a(i), b] (1/L sum_{j on node b} x_j) - alpha * g_i

that is D-PSGD with the mixing matrix ``W = W_nodes ⊗ (1/L) 1 1ᵀ``, doubly stochastic when ``W_nodes`` is and
with the same second eigenvalue, so Lian et al.'s analysis holds with the spectral gap of the graph of
``N`` nodes instead of that of ``N L`` ranks (BlueFog's ``hierarchical_neighbor_allreduce``; Ying et al.,
"BlueFog: Make decentralized algorithms practical for optimization and deep learning", 2021). Per step a
rank sends ``(L - 1)/L`` of the model twice inside the node and its ``1/L`` shard to each neighbouring node.
"""


from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Algorithm, clone_optimizer_state
from ..shared.gossip import gossip_average
from ..shared.hierarchy import GossipTwoLevelConfig, node_gossip_for

__all__ = ["DPSGD", "DPSGDConfig"]


@dataclass(frozen=True)
class DPSGDConfig(GossipTwoLevelConfig):
    """D-PSGD options: those of every algorithm, overlap, hierarchical and node_topology."""


class DPSGD(Algorithm):
    """Decentralized parallel SGD (full-precision neighbour averaging, then a local SGD step)."""

    name = "dpsgd"
    config_class = DPSGDConfig
    resize_family = "decentralized"

    takes_optimizer = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        self.optimizer = self._local_sgd()
        self.node_gossip = node_gossip_for(self.config, self.comm, self.flat.numel, self.flat.data)

    def _begin_exchange(self):
        if not self.config.overlap:
            return None
        return self.comm.ineighbor_allgather(self.flat.data, step=self.step_count)

    def _step(self, grad: torch.Tensor) -> None:
        self._decayed(grad)
        update = self._user_update()
        x = self.flat.data
        if self.node_gossip is not None:
            self.node_gossip.mix(x, self.step_count)
            self._apply_update(update)
            return
        topo = self.comm.topology(self.step_count)
        pending = self._take_pending()
        received = self.comm.neighbor_allgather(x, step=self.step_count) if pending is None else pending.wait()
        gossip_average(x, received, topo.self_weight(self.comm.rank), topo.neighbor_weights(self.comm.rank))
        self._apply_update(update)

    def _extra_state(self):
        return {"optimizer": clone_optimizer_state(self.optimizer)}

    def _load_extra_state(self, extra):
        self.optimizer.load_state_dict(extra["optimizer"])

