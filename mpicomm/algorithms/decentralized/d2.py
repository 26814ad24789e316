"""D²: decentralized training over decentralized data, an extrapolated local step then D-PSGD's gossip.

Tang, Lian, Yan, Zhang, Liu. "D²: Decentralized Training over Decentralized Data." ICML 2018.

Step k on rank i (g_k the stochastic gradient at x_k plus weight_decay * x_k, alpha_k the step size
of step k, W the mixing matrix of ``comm.topology(k)``)::

    x_{1/2}     = x_0 - alpha_0 g_0                                          (first step)
    x_{k+1/2}   = 2 x_k - x_{k-1} - alpha_k g_k + alpha_{k-1} g_{k-1}        (later steps)
    x_{k+1}     = x_{k+1/2} + gamma sum_j W_ij (x_{j,k+1/2} - x_{i,k+1/2})     (``gossip_average``)

That is, mixing with M = (1 - gamma) I + gamma W. D²'s analysis asks for a symmetric W whose smallest
eigenvalue exceeds -1/3: then every mode of x_{k+1} = M (2 x_k - x_{k-1}) but the average contracts, and
at -1/3 one root of r^2 - 2 lambda r + lambda is -1 (a disagreement that oscillates forever). The uniform
ring on an even number n >= 4 of ranks sits exactly at -1/3, so ``gamma`` (None: auto) is 1 where the
graph meets the condition and ``1 / (1 - lambda_min(W))`` where it does not (M's smallest eigenvalue is then
0); a given gamma that breaks it is refused (:func:`d2_gamma`).

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
and doubly stochastic with the eigenvalues of ``W_nodes`` and zeros, so the condition (and gamma) moves from
the graph of ranks to the graph of nodes. A time-varying or asymmetric graph is outside the analysis and
not checked (gamma auto: 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np
import torch

from ...checkpoint.resize_rules import rebuilt_for_new_graph
from ...codecs import chunk_elems, chunk_ranges
from ..base import Algorithm, AlgorithmConfig, check_range, clone_optimizer_state
from ..shared.gossip import gossip_average
from ..shared.hierarchy import NodeGraphConfig, node_gossip_for

__all__ = ["D2", "D2Config", "D2_EIGENVALUE_BOUND", "check_no_momentum", "d2_gamma"]

D2_EIGENVALUE_BOUND = -1.0 / 3.0
"""D²'s condition: the mixing matrix's smallest eigenvalue must exceed this (Tang et al. 2018)."""

_MARGIN = 1e-9


def check_no_momentum(config: AlgorithmConfig) -> None:
    """Raise ``ValueError`` unless ``config.momentum`` is 0 (D²'s update has no momentum term)."""
    if config.momentum != 0.0:
        raise ValueError(f"momentum must be 0 for D² (its update has no momentum term), got {config.momentum!r}")


def _smallest_eigenvalue(graph) -> Union[float, None]:
    """lambda_min(W) of a fixed symmetric graph (a Topology, or a Schedule of period 1); None for any other."""
    if graph.period != 1:
        return None
    topo = graph.at(0)
    if not topo.is_symmetric(tol=1e-12):
        return None
    return float(np.linalg.eigvalsh(topo.W).min())


def d2_gamma(gamma: Union[float, None], default: float, graph) -> float:
    """The consensus step D² mixes with on ``graph`` (``(1 - gamma) I + gamma W``, see the module's docstring).

    ``gamma`` given: returned, or ``ValueError`` if the mixing's smallest eigenvalue is -1/3 or below. None:
    ``default`` where it meets the condition, else ``1 / (1 - lambda_min(W))``. A time-varying or asymmetric
    graph is not checked (``gamma``, or ``default``)."""
    lam = _smallest_eigenvalue(graph)
    if lam is None:
        return default if gamma is None else gamma

    def smallest(g: float) -> float:
        return 1.0 - g * (1.0 - lam)

    if gamma is None:
        return default if smallest(default) > D2_EIGENVALUE_BOUND + _MARGIN else 1.0 / (1.0 - lam)
    if smallest(gamma) <= D2_EIGENVALUE_BOUND + _MARGIN:
        raise ValueError(f"gamma={gamma!r} breaks D²'s condition on {graph.name}: the mixing (1 - gamma) I + gamma W "
                         f"has smallest eigenvalue {smallest(gamma):.4f}, and D² needs it above -1/3 (at or below, "
                         f"the ranks' disagreement stops shrinking); use gamma < {(4.0 / 3.0) / (1.0 - lam):.4f}, or "
                         f"leave it unset (auto: {1.0 / (1.0 - lam):.4f} on this graph)")
    return gamma


@dataclass(frozen=True)
class D2Config(NodeGraphConfig):
    """D² options: those of every algorithm, hierarchical and node_topology; momentum must stay 0.

    gamma: consensus step in (0, 1], D² mixes with (1 - gamma) I + gamma W; None (auto): 1 where W's smallest
    eigenvalue exceeds -1/3, else 1 / (1 - lambda_min(W)) (the uniform ring on an even number >= 4 of ranks:
    3/4). A gamma that breaks D²'s condition on the run's graph is refused when the algorithm is built.
    """

    gamma: Union[float, None] = None

    def __post_init__(self):
        super().__post_init__()
        check_no_momentum(self)
        if self.gamma is not None:
            check_range("gamma", self.gamma, lo=0.0, hi=1.0, lo_open=True)


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
        self.gamma = d2_gamma(self.config.gamma, self._default_gamma(), self._mixing_graph())

    def _default_gamma(self) -> float:
        """gamma where the graph meets D²'s condition and none was given: 1 (plain gossip)."""
        return 1.0

    def _mixing_graph(self):
        """The graph D² mixes on: the graph of nodes when hierarchical, else the run's."""
        return self.comm.schedule if self.node_gossip is None else self.node_gossip.graph.schedule

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
        """x_{k+1} = x_{k+1/2} + gamma sum_j W_ij (x_{j,k+1/2} - x_{i,k+1/2}), as D-PSGD mixes at gamma = 1 (in two
        levels when hierarchical)."""
        if self.node_gossip is not None:
            self.node_gossip.mix(x, self.step_count, self.gamma)
            return
        topo = self.comm.topology(self.step_count)
        rows = self.comm.neighbor_allgather(x, step=self.step_count)
        gossip_average(x, rows, topo.self_weight(self.comm.rank), topo.neighbor_weights(self.comm.rank), self.gamma)

    def stats(self):
        """Base stats plus the consensus step gamma."""
        return {**super().stats(), "gamma": self.gamma}

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
