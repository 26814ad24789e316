"""D²: decentralized training over decentralized data, an extrapolated local step then D-PSGD's gossip.

Tang, Lian, Yan, Zhang, Liu. "D²: Decentralized Training over Decentralized Data." ICML 2018.

Step k on rank i (g_k the stochastic gradient at x_k plus weight_decay * x_k, alpha_k the step size
of step k, W the mixing matrix of ``comm.topology(k)``)::

    x_{1/2}     = x_0 - alpha_0 g_0                                          (first step)
    x_{k+1/2}   = 2 x_k - x_{k-1} - alpha_k g_k + alpha_{k-1} g_{k-1}        (later steps)
    x_{k+1}     = sum_j W_ij x_{j,k+1/2}                                     (``gossip_average``)

Keeping alpha_{k-1} makes learning-rate schedules exact. With a user optimizer its update d_k takes the
place of -alpha_k g_k. Extra memory: x_{k-1} and g_{k-1}. No momentum (a configuration error).
Moniqua-D² (:mod:`mpicomm.algorithms.moniqua.d2`) replaces the last line. Details:
``docs/algorithms/decentralized.md``.

No overlap of the exchange with the forward and backward pass (no ``overlap`` option): what D² sends is
x_{k+1/2}, which holds -alpha_k g_k, so it can only leave after the backward pass of step k (the same
holds for Moniqua-D²).

``hierarchical`` (auto: on over several nodes of several ranks) mixes x_{k+1/2} in two levels, the node's
exact average and then one gossip round on the graph of nodes (``node_topology``), as D-PSGD does
(:mod:`~mpicomm.algorithms.shared.hierarchy`): D² with the mixing matrix ``W_nodes ⊗ (1/L) 1 1ᵀ``, symmetric
and doubly stochastic with the eigenvalues of ``W_nodes`` and zeros. D²'s analysis asks for a symmetric
doubly stochastic W whose smallest eigenvalue exceeds -1/3; the two-level matrix has that of ``W_nodes``
(and zeros), so the condition moves from the graph of ranks to the graph of nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...checkpoint.resize_rules import rebuilt_for_new_graph
from ...codecs import chunk_elems, chunk_ranges
from ..base import Algorithm, AlgorithmConfig, clone_optimizer_state
from ..shared.gossip import gossip_average
from ..shared.hierarchy import NodeGraphConfig, node_gossip_for

__all__ = ["D2", "D2Config", "check_no_momentum"]


def check_no_momentum(config: AlgorithmConfig) -> None:
    """Raise ``ValueError`` unless ``config.momentum`` is 0 (D²'s update has no momentum term)."""
    if config.momentum != 0.0:
        raise ValueError(f"momentum must be 0 for D² (its update has no momentum term), got {config.momentum!r}")


@dataclass(frozen=True)
class D2Config(NodeGraphConfig):
    """D² options: those of every algorithm, hierarchical and node_topology; momentum must stay 0."""

    def __post_init__(self):
        super().__post_init__()
        check_no_momentum(self)


class D2(Algorithm):
    """D²: an extrapolated local step that cancels the data-heterogeneity drift, then full-precision gossip."""

    name = "d2"
    config_class = D2Config
    takes_optimizer = True
    resize_family = "decentralized"

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        x = self.flat.data
        self.x_prev = torch.zeros_like(x)
        self.g_prev = torch.zeros_like(x)
        self.lr_prev = 0.0
        self.started = False
        self._chunk = chunk_elems(x.device)
        self.node_gossip = node_gossip_for(self.config, comm, x.numel(), x)

    def _step(self, grad: torch.Tensor) -> None:
        self._decayed(grad)
        update = self._user_update()
        # the step is lr * direction: alpha_k g_k, or -d_k with a user optimizer (then lr = 1)
        direction, lr = (grad, self.lr) if update is None else (update.neg_(), 1.0)
        x = self.flat.data
        if self.started:  # x_prev <- x_{k+1/2}, then swap, so that x = x_{k+1/2} and x_prev = x_k
            self.x_prev.neg_().add_(x, alpha=2.0).sub_(direction, alpha=lr).add_(self.g_prev, alpha=self.lr_prev)
            self._swap(x, self.x_prev)
        else:
            self.x_prev.copy_(x)
            x.sub_(direction, alpha=lr)
            self.started = True
        self.g_prev.copy_(direction)
        self.lr_prev = lr
        self._mix(x, direction, lr)

    def _mix(self, x: torch.Tensor, direction: torch.Tensor, lr: float) -> None:
        """x_{k+1} = sum_j W_ij x_{j,k+1/2}, exactly as D-PSGD mixes (in two levels when hierarchical)."""
        if self.node_gossip is not None:
            self.node_gossip.mix(x, self.step_count)
            return
        topo = self.comm.topology(self.step_count)
        rows = self.comm.neighbor_allgather(x, step=self.step_count)
        gossip_average(x, rows, topo.self_weight(self.comm.rank), topo.neighbor_weights(self.comm.rank))

    def _swap(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Exchange the contents of ``a`` and ``b`` through one chunk-sized temporary."""
        tmp = torch.empty(min(self._chunk, a.numel()), dtype=a.dtype, device=a.device)
        for start, stop in chunk_ranges(a.numel(), self._chunk):
            t = tmp[:stop - start].copy_(a[start:stop])
            a[start:stop].copy_(b[start:stop])
            b[start:stop].copy_(t)

    def _extra_state(self):
        state = {"x_prev": self.x_prev.clone(), "g_prev": self.g_prev.clone(), "lr_prev": self.lr_prev,
                 "started": self.started}
        if self.user_optimizer:
            state["optimizer"] = clone_optimizer_state(self.optimizer)
        return state

    def _resize_rules(self):
        """On a resize D²'s recursion restarts (its previous iterate and step belong to the old graph): the first
        step after it is a D-PSGD step, as at the start of a run."""
        restart = ("extra.x_prev", "extra.g_prev", "extra.lr_prev", "extra.started")
        return {**super()._resize_rules(), **dict.fromkeys(restart, rebuilt_for_new_graph)}

    def _load_extra_state(self, extra):
        if self.user_optimizer:
            self.optimizer.load_state_dict(extra["optimizer"])
        self.x_prev.copy_(extra["x_prev"])
        self.g_prev.copy_(extra["g_prev"])
        self.lr_prev, self.started = float(extra["lr_prev"]), bool(extra["started"])
